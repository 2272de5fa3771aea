"""InternVL (transformers' native ``InternVLForConditionalGeneration``, the ``-hf`` checkpoints): an InternViT tower
run per image tile (CLS token and learned positions, pre-norm blocks with layer scale and optional q/k norms), the
patch grid pixel-shuffled by ``downsample_ratio`` (each block of neighbours into one row, Idefics3's order), a
projector (LayerNorm, linear, act, linear) and a Qwen2, Qwen3 or Llama decoder.

An image is written ``<IMG_CONTEXT>`` in a prompt. As transformers' InternVLProcessor does (``crop_to_patches``
on), the image processor cuts it into the tile grid whose aspect ratio is nearest the image's (between the
folder's ``min_patches`` and ``max_patches``) plus a thumbnail when there is more than one tile, and the
placeholder becomes ``<img>`` + ``image_seq_length`` context tokens per tile + ``</img>``. Each tile's run is
its own multimodal item (``<image hash>:<tile>``, adjacent runs): a large image (13 tiles x 256 rows in
InternVL3) is encoded a few tiles a step within the step's encoder budget instead of needing it all at once.
"""
from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model_registry.layers import TORCH_OPS, LayerNorm, RMSNorm, ShardsByHeads, empty_param, get_act_fn
from model_registry.layers.params import load_by_name
from model_registry.models.clip import linear
from model_registry.models.idefics3 import pixel_shuffle
from model_registry.models.language_model_shell import LanguageModelShell
from model_registry.models.llama import LlamaForCausalLM
from model_registry.models.llava import load_vlm_weights
from model_registry.models.mm_prompt import image_processor, placeholder_prompt
from model_registry.models.qwen3 import Qwen3ForCausalLM
from vllite_core.attention.backend import AttentionBackend
from vllite_core.errors import ConfigError, InvalidRequestError
from vllite_core.inputs import InputContext, ProcessedPrompt
from vllite_core.model_interfaces import SupportsMultiModalDecoder
from vllite_core.multimodal.features import MultiModalFeature
from vllite_core.multimodal.images import hash_image

START, END = "<img>", "</img>"
DECODERS = {"qwen2": LlamaForCausalLM, "llama": LlamaForCausalLM, "qwen3": Qwen3ForCausalLM}  # by model_type


def _norm(kind: str, d: int, eps: float, dtype: torch.dtype) -> nn.Module:
    if kind == "layer_norm":
        return LayerNorm(d, dtype, eps)
    if kind == "rms_norm":
        return RMSNorm(d, eps, dtype, ops=TORCH_OPS)
    raise NotImplementedError(f"InternVL vision norm_type {kind!r} (layer_norm, rms_norm)")


class InternVisionLayer(nn.Module):
    def __init__(self, c: Any, dtype: torch.dtype) -> None:
        super().__init__()
        d, bias = c.hidden_size, bool(c.attention_bias)
        self.heads = c.num_attention_heads
        self.q_proj, self.k_proj, self.v_proj = (linear(d, d, dtype, bias) for _ in range(3))
        self.projection_layer = linear(d, d, dtype)
        self.q_norm = RMSNorm(d, 1e-6, dtype, ops=TORCH_OPS) if c.use_qk_norm else None
        self.k_norm = RMSNorm(d, 1e-6, dtype, ops=TORCH_OPS) if c.use_qk_norm else None
        self.fc1 = linear(d, c.intermediate_size, dtype)
        self.fc2 = linear(c.intermediate_size, d, dtype)
        self.act = get_act_fn(str(c.hidden_act))
        self.layernorm_before = _norm(c.norm_type, d, c.layer_norm_eps, dtype)
        self.layernorm_after = _norm(c.norm_type, d, c.layer_norm_eps, dtype)
        self.lambda_1 = empty_param(d, dtype=dtype)
        self.lambda_2 = empty_param(d, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.layernorm_before(x)
        q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        ctx = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, d)
        x = x + self.lambda_1 * self.projection_layer(ctx)
        return x + self.lambda_2 * self.fc2(self.act(self.fc1(self.layernorm_after(x))))


class InternVisionTower(nn.Module):
    """Patch conv + CLS + learned positions, the blocks up to the feature layer, the final norm when that layer
    is the last and the config has one (``use_mean_pooling`` off)."""

    def __init__(self, c: Any, feature_layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        d, n = c.hidden_size, c.num_hidden_layers
        self.patch_size, self.image_size = tuple(c.patch_size), tuple(c.image_size)
        grid = (self.image_size[0] // self.patch_size[0]) * (self.image_size[1] // self.patch_size[1])
        self.cls_token = empty_param(1, 1, d, dtype=dtype)
        self.position_embeddings = (empty_param(1, grid + 1, d, dtype=dtype)
                                    if c.use_absolute_position_embeddings else None)
        self.patch_weight = empty_param(d, c.num_channels, *self.patch_size, dtype=dtype)
        self.patch_bias = empty_param(d, dtype=dtype)
        last = feature_layer == -1
        self.layers = nn.ModuleList(InternVisionLayer(c, dtype) for _ in range(n if last else feature_layer % (n + 1)))
        self.layernorm = LayerNorm(d, dtype, c.layer_norm_eps) if last and not c.use_mean_pooling else None

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """Tiles [B, 3, H, W] at the tower's size -> the feature layer's patch states [B, patches, d] (CLS dropped)."""
        if tuple(pixels.shape[-2:]) != self.image_size:
            raise ValueError(f"tiles of {tuple(pixels.shape[-2:])} pixels; the tower takes {self.image_size}")
        x = F.conv2d(pixels.to(self.patch_weight.dtype), self.patch_weight, self.patch_bias, stride=self.patch_size)
        x = torch.cat([self.cls_token.expand(x.shape[0], 1, -1), x.flatten(2).transpose(1, 2)], dim=1)
        if self.position_embeddings is not None:
            x = x + self.position_embeddings
        for layer in self.layers:
            x = layer(x)
        if self.layernorm is not None:
            x = self.layernorm(x)
        return x[:, 1:]

    def param_name(self, hf_name: str) -> str | None:
        """HF names below ``vision_tower.`` -> this module's; None for blocks past the feature layer and an unused
        final norm."""
        name = hf_name.replace("embeddings.patch_embeddings.projection.weight", "patch_weight")
        name = name.replace("embeddings.patch_embeddings.projection.bias", "patch_bias")
        name = name.removeprefix("embeddings.").replace("encoder.layer.", "layers.")
        name = name.replace(".attention.", ".").replace(".mlp.", ".")
        if name.startswith("layers.") and int(name.split(".")[1]) >= len(self.layers):
            return None
        return None if name.startswith("layernorm.") and self.layernorm is None else name

    def load(self, weights: Iterable[tuple[str, torch.Tensor]], copy: object = None) -> set[str]:
        """``load_vlm_weights``' tower contract (its ``copy`` unused: ``load_by_name`` checks and copies)."""
        return load_by_name(self, weights, self.param_name)


class InternVLProjector(nn.Module):
    def __init__(self, cin: int, cout: int, act: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_norm = LayerNorm(cin, dtype)
        self.linear_1 = linear(cin, cout, dtype)
        self.linear_2 = linear(cout, cout, dtype)
        self.act = get_act_fn(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(self.layer_norm(x))))


class InternVLForConditionalGeneration(LanguageModelShell, nn.Module, ShardsByHeads, SupportsMultiModalDecoder):
    """Tensor-parallel: the language model is sharded (its heads must split); the InternViT tower and the projector
    (replicated layers) run whole on every rank, so each rank computes the same image embeddings."""

    tp_sub_config = "text_config"
    supported_modalities = ("image",)

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = hf_config
        vc, tc = hf_config.vision_config, copy.copy(hf_config.get_text_config())
        if tc.model_type not in DECODERS:
            raise NotImplementedError(f"InternVL with a {tc.model_type} decoder is not supported "
                                      f"({', '.join(DECODERS)})")
        if hf_config.vision_feature_select_strategy != "default":
            raise NotImplementedError(f"vision_feature_select_strategy {hf_config.vision_feature_select_strategy!r}")
        layer = hf_config.vision_feature_layer
        if not isinstance(layer, int):  # transformers' class indexes its hidden states by it
            raise ConfigError(f"vision_feature_layer {layer!r}: InternVL takes one layer index (an int)")
        # the top-level config says whether the LM head is the embedding (transformers ties by it)
        tc.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", tc.tie_word_embeddings))
        self.shuffle = round(1 / float(hf_config.downsample_ratio))
        self.vision_tower = InternVisionTower(vc, layer, dtype)
        self.multi_modal_projector = InternVLProjector(vc.hidden_size * self.shuffle ** 2, tc.hidden_size,
                                                       str(hf_config.projector_hidden_act), dtype)
        self.language_model = DECODERS[tc.model_type](tc, attn_backend, dtype)
        self.vocab_size: int = tc.vocab_size
        self.dtype = dtype

    # ---- prompts -----------------------------------------------------------------------------------
    @staticmethod
    def tokens_per_tile(hf_config: Any) -> int:
        vc = hf_config.vision_config
        grid = (vc.image_size[0] // vc.patch_size[0]) * (vc.image_size[1] // vc.patch_size[1])
        return round(grid * float(hf_config.downsample_ratio) ** 2)

    @classmethod
    def process_prompt(cls, prompt: Any, ctx: InputContext) -> ProcessedPrompt:
        """``<IMG_CONTEXT>`` per image in the text (or ``prompt_token_ids``), expanded to ``<img>``, its tiles'
        context tokens, ``</img>``; the tiles' pixels from the folder's image processor with ``crop_to_patches``,
        each tile's run one item."""
        c, tok = ctx.hf_config, ctx.tokenizer
        image_id = cls.image_token_id(c)
        text, ids, images = placeholder_prompt(prompt, ctx, image_id, cls.supported_modalities)
        if not images:
            return ProcessedPrompt(prompt_token_ids=ids, prompt=text)
        n, size = cls.tokens_per_tile(c), tuple(c.vision_config.image_size)
        start, end = tok.convert_tokens_to_ids(START), tok.convert_tokens_to_ids(END)
        out: list[int] = []
        features: list[MultiModalFeature] = []
        it = iter(images)
        for t in ids:
            if t != image_id:
                out.append(t)
                continue
            img = next(it)
            tiles = image_processor(ctx)([img], crop_to_patches=True, return_tensors="pt")["pixel_values"]
            if tuple(tiles.shape[-2:]) != size:
                raise InvalidRequestError("multi_modal_data", f"the image processor gives {tuple(tiles.shape)} "
                                          f"pixels; the vision tower takes {size[0]}x{size[1]} tiles")
            key = hash_image(img)
            out.append(start)
            for k, tile in enumerate(tiles):
                features.append(MultiModalFeature("image", f"{key}:{k}", len(out), n, tile))
                out.extend([image_id] * n)
            out.append(end)
        return ProcessedPrompt(prompt_token_ids=out, prompt=text, mm_features=features)

    # ---- the engine's model contract ---------------------------------------------------------------
    @torch.inference_mode()
    def embed_multimodal(self, tiles: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per tile, its pixel-shuffled, projected patch embeddings [tokens_per_tile, hidden]."""
        dev = self.multi_modal_projector.layer_norm.weight.device
        states = self.vision_tower(torch.stack(tiles).to(dev, self.dtype))
        return list(self.multi_modal_projector(pixel_shuffle(states, self.shuffle)).unbind(0))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_vlm_weights(self, weights)
