"""Falcon-H1 (FalconH1ForCausalLM): every layer runs a Mamba-2 mixer and RoPE attention side by side on the
same normalised input and adds both, then a SwiGLU MLP; muP multipliers scale the embeddings, the
mixer's projections (per section of ``in_proj``), keys, branch outputs, the MLP and the logits.

So each layer holds two caches: the mixer's state, then the attention's paged KV.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model_registry.layers import ColumnParallelLinear, RMSNorm, RowParallelLinear
from model_registry.layers.hybrid import HybridAttention, HybridForCausalLM, HybridStep, head_size
from model_registry.layers.mamba import GatedRMSNorm, Mamba2Dims, Mamba2Mixer
from model_registry.layers.rotary import RotaryEmbedding
from model_registry.layers.tensor_parallel import ShardsMamba2Hybrid
from vllite_core.attention.backend import AttentionBackend


def _mup_vector(c: Any, in_proj: ColumnParallelLinear) -> torch.Tensor:
    """One multiplier per output of this rank's ``in_proj``: its gate, x, B, C and dt rows each get their
    section's."""
    return torch.cat([torch.full((seg.length,), float(m))
                      for seg, m in zip(in_proj.segments.values(), c.ssm_multipliers, strict=True)])


class FalconH1Mixer(Mamba2Mixer):
    """Mamba-2 with muP-scaled projections and Falcon-H1's form of the gated norm (or none: ``y * silu(gate)``)."""

    def __init__(self, c: Any, dtype: torch.dtype) -> None:
        d = Mamba2Dims(hidden_size=c.hidden_size, num_heads=c.mamba_n_heads, head_dim=c.mamba_d_head,
                       n_groups=c.mamba_n_groups, state_size=c.mamba_d_state, conv_kernel=c.mamba_d_conv,
                       chunk_size=c.mamba_chunk_size, use_bias=bool(c.mamba_proj_bias),
                       use_conv_bias=bool(c.mamba_conv_bias), norm_eps=float(c.rms_norm_eps),
                       dt_limit=tuple(c.time_step_limit), activation=c.hidden_act,
                       out_bias=bool(c.projectors_bias))
        super().__init__(d, dtype)
        # In place of Mamba-2's gated norm.
        self.norm = (GatedRMSNorm(d.intermediate, d.intermediate // d.n_groups, d.norm_eps, dtype, self.channels,
                                  float32_weight=True, norm_before_gate=bool(c.mamba_norm_before_gate))
                     if c.mamba_rms_norm else None)
        self.register_buffer("mup_vector", _mup_vector(c, self.in_proj).to(dtype), persistent=False)
        self.in_multiplier = float(c.ssm_in_multiplier)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return self.in_proj(x * self.in_multiplier) * self.mup_vector


class FalconH1Attention(HybridAttention):
    """Keys scaled by ``key_multiplier`` before RoPE."""

    def __init__(self, c: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, head_size(c), attn_backend,
                         dtype, bool(c.attention_bias))
        self.key_multiplier = float(c.key_multiplier)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().project(x)
        return q, k * self.key_multiplier, v


class MLP(nn.Module):
    def __init__(self, c: Any, dtype: torch.dtype) -> None:
        super().__init__()
        bias = bool(c.mlp_bias)
        self.gate_proj = ColumnParallelLinear(c.hidden_size, c.intermediate_size, bias, dtype)
        self.up_proj = ColumnParallelLinear(c.hidden_size, c.intermediate_size, bias, dtype)
        self.down_proj = RowParallelLinear(c.intermediate_size, c.hidden_size, bias, dtype)
        self.gate_multiplier, self.down_multiplier = (float(m) for m in c.mlp_multipliers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.up_proj(x) * F.silu(self.gate_proj(x) * self.gate_multiplier)
        return self.down_proj(y) * self.down_multiplier


class FalconH1Layer(nn.Module):
    def __init__(self, c: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        eps = float(c.rms_norm_eps)
        self.mamba = FalconH1Mixer(c, dtype)
        self.self_attn = FalconH1Attention(c, attn_backend, dtype)
        self.feed_forward = MLP(c, dtype)
        self.input_layernorm = RMSNorm(c.hidden_size, eps, dtype)
        self.pre_ff_layernorm = RMSNorm(c.hidden_size, eps, dtype)
        self.attention_in_multiplier = float(c.attention_in_multiplier)
        self.ssm_out_multiplier = float(c.ssm_out_multiplier)
        self.attention_out_multiplier = float(c.attention_out_multiplier)

    def forward(self, x: torch.Tensor, caches: list[torch.Tensor], mds: list[Any], step: HybridStep
                ) -> torch.Tensor:
        h = self.input_layernorm(x)
        m = self.mamba(h, caches[0], mds[0]) * self.ssm_out_multiplier
        a = self.self_attn(h * self.attention_in_multiplier, caches[1], mds[1], step.rope)
        x = x + (m + a * self.attention_out_multiplier)
        return x + self.feed_forward(self.pre_ff_layernorm(x))


class FalconH1ForCausalLM(HybridForCausalLM, ShardsMamba2Hybrid):
    """Engine model for FalconH1ForCausalLM checkpoints. Tensor-parallel: attention by heads, the mixer by whole
    heads (its muP multipliers and gated norm follow the rank's rows), the MLP by its intermediate channels."""

    mamba2_fields = ("mamba_n_heads", "mamba_n_groups")

    renames = (("model.final_layernorm.", "model.norm."),)

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        c = hf_config
        super().__init__(c, dtype, (FalconH1Layer(c, attn_backend, dtype) for _ in range(c.num_hidden_layers)),
                         float(c.rms_norm_eps))
        self.rotary_emb = RotaryEmbedding(c, head_size(c))
        self.embedding_multiplier = float(c.embedding_multiplier)
        self.lm_head_multiplier = float(c.lm_head_multiplier)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden_states) * self.lm_head_multiplier
