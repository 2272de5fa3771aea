"""LFM2 (Lfm2ForCausalLM): gated short-convolution layers (``layers.mamba.ShortConv``, a state of the last
``conv_L_cache - 1`` inputs) beside attention layers (RoPE, per-head q/k RMS norms) that hold paged KV.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model_registry.layers import ColumnParallelLinear, RMSNorm, RowParallelLinear
from model_registry.layers.hybrid import HybridAttention, HybridForCausalLM, HybridStep, head_size
from model_registry.layers.mamba import ShortConv
from model_registry.layers.rotary import RotaryEmbedding
from model_registry.layers.tensor_parallel import ShardsHybrid
from vllite_core.attention.backend import AttentionBackend
from vllite_core.distributed.sharding import split


class Lfm2Attention(HybridAttention):
    """q and k RMS-normalised per head before RoPE."""

    def __init__(self, c: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, head_size(c), attn_backend,
                         dtype)
        self.q_layernorm = RMSNorm(self.head_size, float(c.norm_eps), dtype)
        self.k_layernorm = RMSNorm(self.head_size, float(c.norm_eps), dtype)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().project(x)
        return self.q_layernorm(q).contiguous(), self.k_layernorm(k).contiguous(), v


def _ffn_size(c: Any) -> int:
    """LFM2's feed-forward width: with ``block_auto_adjust_ff_dim`` two thirds of ``intermediate_size``,
    scaled by ``block_ffn_dim_multiplier`` and rounded up to ``block_multiple_of``."""
    size = c.intermediate_size
    if c.block_auto_adjust_ff_dim:
        size = int(2 * size / 3)
        if c.block_ffn_dim_multiplier is not None:
            size = int(c.block_ffn_dim_multiplier * size)
            size = c.block_multiple_of * ((size + c.block_multiple_of - 1) // c.block_multiple_of)
    return size


class MLP(nn.Module):
    def __init__(self, c: Any, dtype: torch.dtype) -> None:
        super().__init__()
        size = _ffn_size(c)
        self.w1 = ColumnParallelLinear(c.hidden_size, size, False, dtype)
        self.w3 = ColumnParallelLinear(c.hidden_size, size, False, dtype)
        self.w2 = RowParallelLinear(size, c.hidden_size, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Lfm2Layer(nn.Module):
    def __init__(self, c: Any, kind: str, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.is_attention = kind != "conv"
        if self.is_attention:
            self.self_attn = Lfm2Attention(c, attn_backend, dtype)
        else:
            self.conv = ShortConv(c.hidden_size, c.conv_L_cache, bool(c.conv_bias), dtype)
        self.feed_forward = MLP(c, dtype)
        self.operator_norm = RMSNorm(c.hidden_size, float(c.norm_eps), dtype)
        self.ffn_norm = RMSNorm(c.hidden_size, float(c.norm_eps), dtype)

    def forward(self, x: torch.Tensor, caches: list[torch.Tensor], mds: list[Any], step: HybridStep
                ) -> torch.Tensor:
        h = self.operator_norm(x)
        h = self.self_attn(h, caches[0], mds[0], step.rope) if self.is_attention else self.conv(h, caches[0], mds[0])
        x = x + h
        return x + self.feed_forward(self.ffn_norm(x))


class Lfm2ForCausalLM(HybridForCausalLM, ShardsHybrid):
    """Engine model for Lfm2ForCausalLM checkpoints. Tensor-parallel: attention by heads, the short convs by
    channels (any rank count splits them), the MLPs by their intermediate channels."""

    tie_default = True
    renames = (("model.embedding_norm.", "model.norm."), (".self_attn.out_proj.", ".self_attn.o_proj."))

    @classmethod
    def mixer_layout(cls, hf_config: Any, tensor_parallel_size: int, rank: int) -> str:
        c0, c1 = split(hf_config.hidden_size, tensor_parallel_size, rank)
        return f"conv channels {c0}-{c1 - 1} ({c1 - c0}) of {hf_config.hidden_size}"

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        c = hf_config
        super().__init__(c, dtype, (Lfm2Layer(c, kind, attn_backend, dtype) for kind in c.layer_types),
                         float(c.norm_eps))
        self.rotary_emb = RotaryEmbedding(c, head_size(c))
