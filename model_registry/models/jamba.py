"""Jamba (JambaForCausalLM): Mamba-1 layers and attention layers in one stack, dense or MoE feed-forwards.

The hybrid that proves two kinds of cache in one model: attention layers hold paged KV blocks, Mamba layers a
per-request state, all from the one block pool. Attention has no positional encoding (the Mamba layers carry
order). MoE layers route each token to its top-k experts by an unnormalised softmax (``layers.moe``).
Checkpoints may store experts per expert or stacked.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model_registry.layers import ReplicatedLinear, RMSNorm
from model_registry.layers.hybrid import HybridAttention, HybridForCausalLM, HybridStep
from model_registry.layers.mamba import MambaMixer
from model_registry.layers.moe import FusedMoE, TopKRouter
from vllite_core.attention.backend import AttentionBackend


class MLP(nn.Module):
    def __init__(self, c: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = ReplicatedLinear(c.hidden_size, c.intermediate_size, False, dtype)
        self.up_proj = ReplicatedLinear(c.hidden_size, c.intermediate_size, False, dtype)
        self.down_proj = ReplicatedLinear(c.intermediate_size, c.hidden_size, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _mamba_names(c: Any) -> SimpleNamespace:
    return SimpleNamespace(hidden_size=c.hidden_size, intermediate_size=c.mamba_expand * c.hidden_size,
                           state_size=c.mamba_d_state, conv_kernel=c.mamba_d_conv, time_step_rank=c.mamba_dt_rank,
                           use_bias=c.mamba_proj_bias, use_conv_bias=c.mamba_conv_bias, hidden_act=c.hidden_act)


class JambaLayer(nn.Module):
    def __init__(self, c: Any, kind: str, num_experts: int, attn_backend: AttentionBackend,
                 dtype: torch.dtype) -> None:
        super().__init__()
        eps = float(c.rms_norm_eps)
        self.kind = kind
        if kind == "attention":
            self.self_attn = HybridAttention.from_config(c, attn_backend, dtype)
        else:
            self.mamba = MambaMixer(_mamba_names(c), dtype, rms_eps=eps, norm_weights=True)
        self.feed_forward = MLP(c, dtype) if num_experts <= 1 else FusedMoE(
            TopKRouter(c.hidden_size, num_experts, c.num_experts_per_tok, dtype), c.hidden_size,
            c.intermediate_size, dtype)
        self.input_layernorm = RMSNorm(c.hidden_size, eps, dtype)
        self.pre_ff_layernorm = RMSNorm(c.hidden_size, eps, dtype)

    def forward(self, x: torch.Tensor, caches: list[torch.Tensor], mds: list[Any], step: HybridStep
                ) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.kind == "attention":
            h = self.self_attn(h, caches[0], mds[0], step.rope)
        else:
            h = self.mamba(h, caches[0], mds[0])
        x = x + h
        return x + self.feed_forward(self.pre_ff_layernorm(x))


class JambaForCausalLM(HybridForCausalLM):
    """Engine model for JambaForCausalLM checkpoints (per-expert or stacked expert weights)."""

    renames = (("model.final_layernorm.", "model.norm."),
               (".feed_forward.experts.gate_up_proj", ".feed_forward.w13_weight"),
               (".feed_forward.experts.down_proj", ".feed_forward.w2_weight"))

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        c = hf_config
        super().__init__(c, dtype, (JambaLayer(c, kind, n, attn_backend, dtype)
                                    for kind, n in zip(c.layers_block_type, c.layers_num_experts)),
                         float(c.rms_norm_eps))
