"""The SigLIP vision tower (Gemma 3's image encoder): patch embedding with a bias, learned positions (no class
token), CLIP-shaped encoder layers, a final layer norm. Plain torch, off the decode path (outputs are cached)."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model_registry.layers import LayerNorm, empty_param
from model_registry.models.clip import CLIPEncoderLayer


class SiglipVisionTower(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.patch_size = cfg.patch_size
        self.num_positions = (cfg.image_size // cfg.patch_size) ** 2
        self.patch_embedding = empty_param(d, cfg.num_channels, cfg.patch_size, cfg.patch_size, dtype=dtype)
        self.patch_bias = empty_param(d, dtype=dtype)
        self.position_embedding = empty_param(self.num_positions, d, dtype=dtype)
        self.layers = nn.ModuleList(CLIPEncoderLayer(cfg, dtype) for _ in range(cfg.num_hidden_layers))
        self.post_layernorm = LayerNorm(d, dtype, cfg.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] -> the last hidden state, normed: [B, patches, d]."""
        x = F.conv2d(pixels.to(self.patch_embedding.dtype), self.patch_embedding, self.patch_bias,
                     stride=self.patch_size)
        x = x.flatten(2).transpose(1, 2)
        if x.shape[1] != self.num_positions:
            raise ValueError(f"the image gives {x.shape[1]} patches, the tower has {self.num_positions} positions")
        x = x + self.position_embedding
        for layer in self.layers:
            x = layer(x)
        return self.post_layernorm(x)

    @staticmethod
    def param_name(hf_name: str) -> str:
        """HF names below the tower (with or without ``vision_model.``) -> this module's."""
        name = hf_name.removeprefix("vision_model.")
        name = name.replace("embeddings.patch_embedding.weight", "patch_embedding")
        name = name.replace("embeddings.patch_embedding.bias", "patch_bias")
        name = name.replace("embeddings.position_embedding.weight", "position_embedding")
        return name.replace("encoder.layers.", "layers.").replace(".mlp.fc", ".fc")

    def load(self, weights: Iterable[tuple[str, torch.Tensor]], copy) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = self.param_name(hf_name)
            if name.endswith("position_ids"):
                continue
            if name not in params:
                raise ValueError(f"checkpoint has vision weights this model does not know: vision_tower.{hf_name}")
            copy(params[name].data, tensor, hf_name)
            loaded.add(name)
        return loaded
