"""Mamba-2 (Mamba2ForCausalLM) written for the engine, and the Mamba-2 mixer the hybrids reuse.

The mixer's per-request memory is a convolution state over x, B and C (``conv_dim x (kernel - 1)``)
and an SSM state of ``heads x head_dim x state_size``: one ``StateSpec`` per layer. Prefill runs the
chunked SSD scan, decode one recurrent step, both through the platform's model ops
(``ModelOps.ssd_scan``). Module names follow the HF checkpoint's.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from model_registry.layers import ReplicatedLinear, RMSNorm
from model_registry.models.hf_weights import load_by_name, tie_loaded
from model_registry.models.mamba import Conv1d, Embedding, _param
from vllite_core.core.kv_cache_spec import KVCacheSpec, StateSpec
from vllite_core.model_interfaces import IsStateful
from vllite_core.model_ops import current_model_ops
from vllite_core.state_cache import StateMetadata, gather_states, scatter_states


@dataclass(frozen=True)
class Mamba2Dims:
    """A Mamba-2 mixer's geometry (each hybrid's config names these fields its own way)."""

    hidden_size: int
    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int
    chunk_size: int
    use_bias: bool
    use_conv_bias: bool
    norm_eps: float
    dt_limit: tuple[float, float] = (0.0, float("inf"))
    activation: str = "silu"

    @property
    def intermediate(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate + 2 * self.n_groups * self.state_size


class GatedRMSNorm(nn.Module):
    """RMS norm of ``x * silu(gate)`` over groups of channels, in float32, then scaled."""

    def __init__(self, size: int, group_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(size, dtype=dtype)
        self.group_size = group_size
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = self.weight.dtype
        h = x.float() * torch.nn.functional.silu(gate.float())
        g = h.view(*h.shape[:-1], -1, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.view(h.shape).to(dtype)


class Mamba2Mixer(nn.Module):
    def __init__(self, d: Mamba2Dims, dtype: torch.dtype) -> None:
        super().__init__()
        self.d = d
        self.in_proj = ReplicatedLinear(d.hidden_size, d.intermediate + d.conv_dim + d.num_heads, d.use_bias, dtype)
        self.conv1d = Conv1d(d.conv_dim, d.conv_kernel, d.use_conv_bias, dtype)
        self.dt_bias = _param(d.num_heads, dtype=dtype)
        self.A_log = _param(d.num_heads, dtype=dtype)
        self.D = _param(d.num_heads, dtype=dtype)
        self.norm = GatedRMSNorm(d.intermediate, d.intermediate // d.n_groups, d.norm_eps, dtype)
        self.out_proj = ReplicatedLinear(d.intermediate, d.hidden_size, d.use_bias, dtype)
        self._ops = current_model_ops()

    @property
    def state_shapes(self) -> list[tuple[int, ...]]:
        d = self.d
        return [(d.conv_dim, d.conv_kernel - 1), (d.num_heads, d.head_dim, d.state_size)]

    def forward(self, x: torch.Tensor, cache: torch.Tensor, md: StateMetadata) -> torch.Tensor:
        d, ops, qsl = self.d, self._ops, md.query_start_loc_cpu
        states = gather_states(cache, md, tuple(self.state_shapes))
        conv_state, ssm_state = states
        gate, xbc, dt = self.in_proj(x).split([d.intermediate, d.conv_dim, d.num_heads], dim=-1)
        xbc = ops.causal_conv1d(xbc.contiguous(), self.conv1d.weight[:, 0, :], self.conv1d.bias, conv_state, qsl,
                                d.activation)
        gn = d.n_groups * d.state_size
        xs, B, C = xbc.split([d.intermediate, gn, gn], dim=-1)
        t = x.shape[0]
        y = ops.ssd_scan(xs.reshape(t, d.num_heads, d.head_dim), dt, -torch.exp(self.A_log.float()),
                         B.reshape(t, d.n_groups, d.state_size), C.reshape(t, d.n_groups, d.state_size), self.D,
                         self.dt_bias, d.dt_limit, d.chunk_size, ssm_state, qsl)
        scatter_states(cache, md, states)
        return self.out_proj(self.norm(y.reshape(t, d.intermediate).to(x.dtype), gate))


def mamba2_dims(c: Any) -> Mamba2Dims:
    return Mamba2Dims(hidden_size=c.hidden_size, num_heads=c.num_heads, head_dim=c.head_dim, n_groups=c.n_groups,
                      state_size=c.state_size, conv_kernel=c.conv_kernel, chunk_size=c.chunk_size,
                      use_bias=bool(c.use_bias), use_conv_bias=bool(c.use_conv_bias),
                      norm_eps=float(c.layer_norm_epsilon), dt_limit=tuple(c.time_step_limit),
                      activation=c.hidden_act)


class Mamba2Block(nn.Module):
    def __init__(self, c: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.residual_in_fp32 = bool(getattr(c, "residual_in_fp32", True))
        self.norm = RMSNorm(c.hidden_size, float(c.layer_norm_epsilon), dtype)
        self.mixer = Mamba2Mixer(mamba2_dims(c), dtype)

    def forward(self, x: torch.Tensor, cache: torch.Tensor, md: StateMetadata) -> torch.Tensor:
        residual = x.float() if self.residual_in_fp32 else x
        return residual + self.mixer(self.norm(x.to(self.norm.weight.dtype)), cache, md)


class Mamba2Backbone(nn.Module):
    def __init__(self, c: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.embeddings = Embedding(c.vocab_size, c.hidden_size, dtype)
        self.layers = nn.ModuleList(Mamba2Block(c, dtype) for _ in range(c.num_hidden_layers))
        self.norm_f = RMSNorm(c.hidden_size, float(c.layer_norm_epsilon), dtype)

    def forward(self, input_ids: torch.Tensor, caches: list[torch.Tensor], mds: list[StateMetadata]) -> torch.Tensor:
        x = self.embeddings(input_ids)
        for layer, cache, md in zip(self.layers, caches, mds, strict=True):
            x = layer(x, cache, md)
        return self.norm_f(x.to(self.norm_f.weight.dtype))


class Mamba2ForCausalLM(nn.Module, IsStateful):
    """Engine model for Mamba2ForCausalLM checkpoints (HF names: ``backbone.*``, ``lm_head.weight``)."""

    def __init__(self, hf_config: Any, attn_backend: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = hf_config
        self.dtype = dtype
        self.vocab_size: int = hf_config.vocab_size
        self.backbone = Mamba2Backbone(hf_config, dtype)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head = (self.backbone.embeddings.weight if self.tie_word_embeddings
                        else _param(self.vocab_size, hf_config.hidden_size, dtype=dtype))
        self._ops = current_model_ops()
        self._head_state: dict = {}

    def get_kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec]:
        return [StateSpec.of(block_size, layer.mixer.state_shapes, self.dtype) for layer in self.backbone.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: list[Any]) -> torch.Tensor:
        return self.backbone(input_ids, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self._ops.linear(hidden_states, self.lm_head, None, self._head_state).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def rename(name: str) -> str | None:
            name = name.replace("backbone.embedding.", "backbone.embeddings.")
            if name == "lm_head.weight":
                return None if self.tie_word_embeddings else "lm_head"
            return name

        loaded = load_by_name(self, weights, rename)
        if self.tie_word_embeddings:
            tie_loaded(self, loaded, "lm_head", "backbone.embeddings.weight")
        return loaded
