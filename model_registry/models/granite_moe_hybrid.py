"""GraniteMoeHybrid (GraniteMoeHybridForCausalLM): Mamba-2 or attention layers, each followed by a top-k MoE
plus a shared SwiGLU MLP, with Granite's scalar multipliers (embeddings, residual branches, attention
scale, logits).

Mamba-2 layers hold a state, attention layers paged KV (RoPE only when ``position_embedding_type ==
"rope"``). The router softmaxes over the top-k logits (``layers.moe``); the shared MLP is the MoE's shared
expert, or the whole feed-forward of a model without experts.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from model_registry.layers import RMSNorm
from model_registry.layers.hybrid import HybridAttention, HybridForCausalLM, HybridStep, head_size
from model_registry.layers.mamba import Mamba2Dims, Mamba2Mixer
from model_registry.layers.mlp import GatedMLP
from model_registry.layers.moe import FusedMoE, TopKRouter
from model_registry.layers.rotary import RotaryEmbedding
from model_registry.layers.tensor_parallel import ShardsMamba2Hybrid
from vllite_core.attention.backend import AttentionBackend

_RENAMES = ((".block_sparse_moe.router.layer.", ".feed_forward.router."),
            (".block_sparse_moe.input_linear.weight", ".feed_forward.w13_weight"),
            (".block_sparse_moe.output_linear.weight", ".feed_forward.w2_weight"),
            (".shared_mlp.input_linear.", ".shared_mlp.gate_up_proj."),
            (".shared_mlp.output_linear.", ".shared_mlp.down_proj."))


def _dims(c: Any) -> Mamba2Dims:
    return Mamba2Dims(hidden_size=c.hidden_size, num_heads=c.mamba_n_heads, head_dim=c.mamba_d_head,
                      n_groups=c.mamba_n_groups, state_size=c.mamba_d_state, conv_kernel=c.mamba_d_conv,
                      chunk_size=c.mamba_chunk_size, use_bias=bool(c.mamba_proj_bias),
                      use_conv_bias=bool(c.mamba_conv_bias), norm_eps=float(c.rms_norm_eps),
                      dt_limit=tuple(c.time_step_limit), activation=c.hidden_act)


class GraniteLayer(nn.Module):
    def __init__(self, c: Any, kind: str, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.kind = kind
        eps = float(c.rms_norm_eps)
        self.input_layernorm = RMSNorm(c.hidden_size, eps, dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, eps, dtype)
        if kind == "linear_attention":
            self.mamba = Mamba2Mixer(_dims(c), dtype)
        else:
            self.self_attn = HybridAttention.from_config(c, attn_backend, dtype, bool(c.attention_bias),
                                                         float(c.attention_multiplier))
        if c.num_local_experts > 0:
            router = TopKRouter(c.hidden_size, c.num_local_experts, c.num_experts_per_tok, dtype, renormalize=True)
            self.feed_forward: nn.Module = FusedMoE(router, c.hidden_size, c.intermediate_size, dtype,
                                                    shared_intermediate_size=c.shared_intermediate_size)
        else:
            self.feed_forward = GatedMLP(c.hidden_size, c.shared_intermediate_size, dtype)
        self.residual_multiplier = float(c.residual_multiplier)

    def forward(self, x: torch.Tensor, caches: list[torch.Tensor], mds: list[Any], step: HybridStep
                ) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.kind == "linear_attention":
            h = self.mamba(h, caches[0], mds[0])
        else:
            h = self.self_attn(h, caches[0], mds[0], step.rope)
        x = x + h * self.residual_multiplier
        return x + self.feed_forward(self.post_attention_layernorm(x)) * self.residual_multiplier


class GraniteMoeHybridForCausalLM(HybridForCausalLM, ShardsMamba2Hybrid):
    """Engine model for GraniteMoeHybridForCausalLM checkpoints. Tensor-parallel: attention by heads, the Mamba-2
    mixers by whole heads, the experts and the shared MLP by their intermediate channels (the router whole)."""

    mamba2_fields = ("mamba_n_heads", "mamba_n_groups")

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        c = hf_config
        super().__init__(c, dtype, (GraniteLayer(c, kind, attn_backend, dtype) for kind in c.layers_block_type),
                         float(c.rms_norm_eps))
        # The feed-forward is the MoE (the shared MLP its shared expert) or, without experts, the shared MLP.
        ffn = ".feed_forward.shared_experts." if c.num_local_experts > 0 else ".feed_forward."
        self.renames = (*_RENAMES, (".shared_mlp.", ffn))
        if c.position_embedding_type == "rope":
            self.rotary_emb = RotaryEmbedding(c, head_size(c))
        self.embedding_multiplier = float(c.embedding_multiplier)
        self.logits_scaling = float(c.logits_scaling)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden_states) / self.logits_scaling
