"""Jamba (JambaForCausalLM): Mamba-1 layers and attention layers in one stack, dense or MoE feed-forwards.

The hybrid that proves two kinds of cache in one model: attention layers hold paged KV blocks, Mamba layers a
per-request state, all from the one block pool. Attention has no positional encoding (the Mamba layers carry
order). MoE layers route each token to its top-k experts by an unnormalised softmax (``layers.moe``).
Checkpoints may store experts per expert or stacked.
"""
from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from model_registry.layers import (
    DecoderLayerRecord,
    GatedMLP,
    NormRecord,
    RMSNorm,
    ShardsByHeads,
)
from model_registry.layers.hybrid import HybridAttention, HybridForCausalLM, HybridStep
from model_registry.layers.mamba import MambaMixer
from model_registry.layers.moe import FusedMoE, TopKRouter
from vllite_core.attention.backend import AttentionBackend
from vllite_core.model_ops import current_model_ops


def _mamba_names(c: Any) -> SimpleNamespace:
    return SimpleNamespace(hidden_size=c.hidden_size, intermediate_size=c.mamba_expand * c.hidden_size,
                           state_size=c.mamba_d_state, conv_kernel=c.mamba_d_conv, time_step_rank=c.mamba_dt_rank,
                           use_bias=c.mamba_proj_bias, use_conv_bias=c.mamba_conv_bias, hidden_act=c.hidden_act)


class JambaLayer(nn.Module):
    """A Mamba mixer or attention, then a dense or MoE feed-forward, each pre-norm with its residual add.
    Attention with a dense MLP is a Llama-style layer without RoPE: it offers the platform's fused path."""

    def __init__(self, c: Any, kind: str, num_experts: int, attn_backend: AttentionBackend,
                 dtype: torch.dtype) -> None:
        super().__init__()
        eps = float(c.rms_norm_eps)
        self.kind = kind
        if kind == "attention":
            self.self_attn = HybridAttention.from_config(c, attn_backend, dtype)
        else:
            self.mamba = MambaMixer(_mamba_names(c), dtype, rms_eps=eps, norm_weights=True)
        if num_experts <= 1:
            self.feed_forward: nn.Module = GatedMLP(c.hidden_size, c.intermediate_size, dtype)
        else:
            router = TopKRouter(c.hidden_size, num_experts, c.num_experts_per_tok, dtype)
            self.feed_forward = FusedMoE(router, c.hidden_size, c.intermediate_size, dtype)
        self.input_layernorm = RMSNorm(c.hidden_size, eps, dtype)
        self.pre_ff_layernorm = RMSNorm(c.hidden_size, eps, dtype)
        self.ops = current_model_ops()
        self._native: Any = None  # the platform's whole-layer call or False; made on first use

    def fast_path_record(self) -> DecoderLayerRecord | str:
        """The layer as a platform's fused path reads it (``rope=None``: Jamba's attention has no positional
        rotation), or why it has no such form."""
        if self.kind != "attention":
            return "a Mamba mixer layer"
        if not isinstance(self.feed_forward, GatedMLP):
            return "an MoE feed-forward"
        norms, attn, mlp = (self.input_layernorm, self.pre_ff_layernorm), self.self_attn, self.feed_forward
        return DecoderLayerRecord(
            input_norm=NormRecord("rms", norms[0].weight, float(norms[0].eps)),
            post_attention_norm=NormRecord("rms", norms[1].weight, float(norms[1].eps)),
            qkv_proj=attn.qkv_proj, o_proj=attn.o_proj, gate_up_proj=mlp.gate_up_proj, down_proj=mlp.down_proj,
            attention=attn.attn, activation="silu", rope=None, ops=self.ops)

    def native_layer(self) -> Callable[..., tuple[torch.Tensor, torch.Tensor] | None] | None:
        """The platform's whole-layer call (``ModelOps.decoder_layer``), or None; made on first use, after
        loading, when the weights are the final ones."""
        if self._native is None:
            self._native = self.ops.decoder_layer(self.fast_path_record()) or False
        return self._native or None

    def forward(self, x: torch.Tensor, caches: list[torch.Tensor], mds: list[Any], step: HybridStep
                ) -> torch.Tensor:
        native = self.native_layer()
        if native:
            # The call makes its input the residual stream in place: the step's embeddings are read again by
            # other hybrids, so never handed over.
            out = native(None, x.clone() if x is step.embeddings else x, None, caches[0], mds[0])
            if out is not None:
                return out[0] + out[1]  # (x + attention) + feed-forward, as below
        h = self.input_layernorm(x)
        if self.kind == "attention":
            h = self.self_attn(h, caches[0], mds[0], step.rope)
        else:
            h = self.mamba(h, caches[0], mds[0])
        x = x + h
        return x + self.feed_forward(self.pre_ff_layernorm(x))


class JambaForCausalLM(HybridForCausalLM, ShardsByHeads):
    """Engine model for JambaForCausalLM checkpoints (per-expert or stacked expert weights). Tensor-parallel:
    every part is a parallel layer (attention heads, the Mamba mixers' channels, the MLP and experts' width)."""

    renames = (("model.final_layernorm.", "model.norm."),
               (".feed_forward.experts.gate_up_proj", ".feed_forward.w13_weight"),
               (".feed_forward.experts.down_proj", ".feed_forward.w2_weight"))

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        c = hf_config
        kinds = list(zip(c.layers_block_type, c.layers_num_experts))
        super().__init__(c, dtype, lambda i: JambaLayer(c, *kinds[i], attn_backend, dtype), float(c.rms_norm_eps))

    # Pipeline stages: each rank builds its stage's layers; a stage may hold only Mamba layers (a state per
    # request) or only attention layers (paged KV), and allocates only those (vllite_core.worker.pp_runner).
    supports_pipeline_parallel = True

    @classmethod
    def layer_kinds(cls, hf_config: Any) -> list[str]:
        """Each layer's mixer (``vllite env`` shows what caches each pipeline stage holds)."""
        return [f"{k} layer(s)" for k in hf_config.layers_block_type]
