"""The CLIP vision tower (the image encoder of Llava and its kin), written for the engine.

Images arrive as a batch of same-sized pixel tensors [B, 3, H, W]; the tower returns the hidden states of
every layer the caller asks for (Llava reads the penultimate one). Plain torch: the tower runs once per image
and its output is cached, so it is off the decode path.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model_registry.layers import TORCH_OPS, LayerNorm, ReplicatedLinear, empty_param, get_act_fn


def linear(cin: int, cout: int, dtype: torch.dtype, bias: bool = True) -> ReplicatedLinear:
    """A tower's projection: the whole weight on every rank, plain ``F.linear`` (HF's numerics)."""
    return ReplicatedLinear(cin, cout, bias, dtype, ops=TORCH_OPS)


class CLIPAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = linear(dim, dim, dtype)
        self.k_proj = linear(dim, dim, dtype)
        self.v_proj = linear(dim, dim, dtype)
        self.out_proj = linear(dim, dim, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (p(x).view(b, s, self.num_heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v)  # full attention over the patches, scale head_dim ** -0.5
        return self.out_proj(out.transpose(1, 2).reshape(b, s, d))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.layer_norm_eps
        self.layer_norm1 = LayerNorm(d, dtype, eps)
        self.self_attn = CLIPAttention(d, cfg.num_attention_heads, dtype)
        self.layer_norm2 = LayerNorm(d, dtype, eps)
        self.fc1 = linear(d, cfg.intermediate_size, dtype)
        self.fc2 = linear(cfg.intermediate_size, d, dtype)
        self.act = get_act_fn(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.fc2(self.act(self.fc1(self.layer_norm2(x))))


class CLIPVisionTower(nn.Module):
    """Patch embedding + class token + learned positions, pre-norm, the encoder layers."""

    def __init__(self, cfg: Any, dtype: torch.dtype, num_layers: int | None = None) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.patch_size = cfg.patch_size
        self.num_positions = (cfg.image_size // cfg.patch_size) ** 2 + 1
        self.class_embedding = empty_param(d, dtype=dtype)
        self.patch_embedding = empty_param(d, cfg.num_channels, cfg.patch_size, cfg.patch_size, dtype=dtype)
        self.position_embedding = empty_param(self.num_positions, d, dtype=dtype)
        self.pre_layrnorm = LayerNorm(d, dtype, cfg.layer_norm_eps)
        n = cfg.num_hidden_layers if num_layers is None else num_layers
        self.layers = nn.ModuleList(CLIPEncoderLayer(cfg, dtype) for _ in range(n))

    def forward(self, pixels: torch.Tensor, layer_ids: list[int]) -> list[torch.Tensor]:
        """Hidden states after each layer in ``layer_ids`` (0: the embeddings, i: after layer i)."""
        patches = F.conv2d(pixels.to(self.patch_embedding.dtype), self.patch_embedding, stride=self.patch_size)
        patches = patches.flatten(2).transpose(1, 2)  # [B, N, d]
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        x = torch.cat([cls, patches], dim=1)
        if x.shape[1] != self.num_positions:
            raise ValueError(f"the image gives {x.shape[1] - 1} patches, the tower has positions for "
                             f"{self.num_positions - 1}")
        x = self.pre_layrnorm(x + self.position_embedding)
        states = {0: x}
        for i, layer in enumerate(self.layers, start=1):
            x = layer(x)
            states[i] = x
        return [states[i] for i in layer_ids]

    # HF names (below vision_tower., with or without vision_model.) -> this module's.
    @staticmethod
    def param_name(hf_name: str) -> str:
        name = hf_name.removeprefix("vision_model.")
        name = name.replace("embeddings.patch_embedding.weight", "patch_embedding")
        name = name.replace("embeddings.class_embedding", "class_embedding")
        name = name.replace("embeddings.position_embedding.weight", "position_embedding")
        name = name.replace("encoder.layers.", "layers.").replace(".mlp.fc", ".fc")
        return name

    def load(self, weights: Iterable[tuple[str, torch.Tensor]], copy) -> set[str]:
        """Copy HF-named tensors (names below the tower); tensors of layers past the ones kept (and the unused
        post-layernorm) are skipped. Returns the parameter names filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = self.param_name(hf_name)
            if name.startswith("post_layernorm.") or name.endswith("position_ids"):
                continue
            if name.startswith("layers.") and int(name.split(".")[1]) >= len(self.layers):
                continue
            if name not in params:
                raise ValueError(f"checkpoint has vision weights this model does not know: vision_tower.{hf_name}")
            copy(params[name].data, tensor, hf_name)
            loaded.add(name)
        return loaded
