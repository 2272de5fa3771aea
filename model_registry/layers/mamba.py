"""State-space and convolution mixers: layers whose per-request memory is a fixed state, not a KV cache.

Each mixer (a ``MambaBase``) declares its state tensors (``state_shapes``: a convolution state of the last
``kernel - 1`` inputs, and an SSM state), one ``StateSpec`` per layer (``vllite_core/state_cache.py``). The
step's tokens arrive flattened; the causal conv and the scans run through the platform's model ops, which
carry each request's state across prefill chunks and decode steps.

- ``MambaMixer``: Mamba-1's selective scan (Mamba, FalconMamba, Jamba), tensor-parallel over its channels;
- ``Mamba2Mixer``: Mamba-2's SSD scan (Mamba2 and the hybrids built on it), geometry in ``Mamba2Dims``;
- ``ShortConv``: a gated short convolution (LFM2).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model_registry.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from model_registry.layers.norm import RMSNorm, rms_normalize
from model_registry.layers.params import empty_param, rows_param
from vllite_core.core.kv_cache_spec import StateSpec
from vllite_core.distributed import get_tp
from vllite_core.distributed.sharding import split
from vllite_core.model_ops import ModelOps, current_model_ops
from vllite_core.state_cache import StateMetadata, gather_states, scatter_states


class CausalConv1d(nn.Module):
    """A depthwise causal conv (weights in the checkpoint's layout, [channels, 1, kernel]) that continues each
    request from its conv state: ``ModelOps.causal_conv1d``. ``rows``: the channels this rank holds (all)."""

    def __init__(self, channels: int, kernel: int, bias: bool, dtype: torch.dtype,
                 rows: tuple[int, int] | None = None) -> None:
        super().__init__()
        rows = rows or (0, channels)
        self.weight = rows_param(rows, channels, 1, kernel, dtype=dtype)
        self.bias = rows_param(rows, channels, dtype=dtype) if bias else None

    def run(self, ops: ModelOps, x: torch.Tensor, conv_state: torch.Tensor, md: StateMetadata,
            activation: str | None) -> torch.Tensor:
        """The causal conv over each request's tokens, continuing from and updating ``conv_state``."""
        return ops.causal_conv1d(x.contiguous(), self.weight[:, 0, :], self.bias, conv_state,
                                 md.query_start_loc_cpu, activation)


class MambaBase(nn.Module):
    """A mixer holding per-request state: gathers its rows of the state cache, mixes, writes them back."""

    ops: ModelOps

    @property
    def state_shapes(self) -> list[tuple[int, ...]]:
        raise NotImplementedError

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> StateSpec:
        """One state row per request, in ``dtype`` (the model's: the recurrence accumulates, no quantisation)."""
        return StateSpec.of(block_size, self.state_shapes, dtype)

    def mix(self, x: torch.Tensor, states: list[torch.Tensor], md: StateMetadata) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, cache: torch.Tensor, md: StateMetadata) -> torch.Tensor:
        states = gather_states(cache, md, tuple(self.state_shapes))
        y = self.mix(x, states, md)
        scatter_states(cache, md, states)
        return y


class MambaMixer(MambaBase):
    """``c`` carries Mamba's config names (hybrids pass theirs renamed). ``rms_eps`` set: dt, B and C are
    RMS-normalised before the scan, with weights (``dt_layernorm`` ...: Jamba) when ``norm_weights``."""

    def __init__(self, c: Any, dtype: torch.dtype, rms_eps: float | None = None, norm_weights: bool = False
                 ) -> None:
        super().__init__()
        full = c.intermediate_size
        # Tensor-parallel: each rank holds its channels of the mixer (in_proj's x and gate rows, the conv, the
        # scan's A, D and dt rows); x_proj and out_proj read those channels and sum over the ranks.
        tp = get_tp()
        rows = split(full, tp.world_size, tp.rank)
        self.intermediate = rows[1] - rows[0]  # this rank's channels
        self.state_size = c.state_size
        self.kernel = c.conv_kernel
        self.dt_rank = int(c.time_step_rank)
        self.activation = c.hidden_act
        self.rms_eps = rms_eps  # FalconMamba: B, C and dt are RMS-normalised
        self.in_proj = MergedColumnParallelLinear(c.hidden_size, {"x": full, "gate": full}, bool(c.use_bias), dtype)
        self.conv1d = CausalConv1d(full, self.kernel, bool(c.use_conv_bias), dtype, rows)
        self.x_proj = RowParallelLinear(full, self.dt_rank + 2 * self.state_size, False, dtype, rows)
        self.dt_proj = ColumnParallelLinear(self.dt_rank, full, True, dtype, out_range=rows)
        self.A_log = rows_param(rows, full, self.state_size, dtype=dtype)
        self.D = rows_param(rows, full, dtype=dtype)
        self.out_proj = RowParallelLinear(full, c.hidden_size, bool(c.use_bias), dtype, rows)
        self.norm_weights = norm_weights
        if norm_weights:
            assert rms_eps is not None
            self.dt_layernorm = RMSNorm(self.dt_rank, rms_eps, dtype)
            self.b_layernorm = RMSNorm(self.state_size, rms_eps, dtype)
            self.c_layernorm = RMSNorm(self.state_size, rms_eps, dtype)
        self.ops = current_model_ops()

    @property
    def state_shapes(self) -> list[tuple[int, ...]]:
        return [(self.intermediate, self.kernel - 1), (self.intermediate, self.state_size)]

    def mix(self, x: torch.Tensor, states: list[torch.Tensor], md: StateMetadata) -> torch.Tensor:
        conv_state, ssm_state = states
        xs, gate = self.in_proj(x).chunk(2, dim=-1)
        xs = self.conv1d.run(self.ops, xs, conv_state, md, self.activation)
        dt, B, C = self.x_proj(xs).split([self.dt_rank, self.state_size, self.state_size], dim=-1)
        if self.norm_weights:
            dt, B, C = self.dt_layernorm(dt), self.b_layernorm(B), self.c_layernorm(C)
        elif self.rms_eps is not None:
            B, C, dt = rms_normalize(B, self.rms_eps), rms_normalize(C, self.rms_eps), rms_normalize(dt, self.rms_eps)
        dt = F.linear(dt, self.dt_proj.weight)  # the bias is added in float32 inside the scan
        A = -torch.exp(self.A_log.float())
        y = self.ops.selective_scan(xs, dt, A, B.contiguous(), C.contiguous(), self.D.float(), gate,
                                    self.dt_proj.bias.float(), ssm_state, md.query_start_loc_cpu)
        return self.out_proj(y)


@dataclass(frozen=True)
class Mamba2Dims:
    """A Mamba-2 mixer's geometry (each hybrid's config names these fields its own way). ``out_bias``:
    ``out_proj``'s bias when it differs from ``in_proj``'s (Falcon-H1)."""

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
    out_bias: bool | None = None

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
        self.weight = empty_param(size, dtype=dtype)
        self.group_size = group_size
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = self.weight.dtype
        h = x.float() * F.silu(gate.float())
        g = h.view(*h.shape[:-1], -1, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.view(h.shape).to(dtype)


class Mamba2Mixer(MambaBase):
    """Mamba-2: in_proj to (gate, x|B|C, dt), the causal conv over x|B|C, the SSD scan, a gated norm, out_proj.
    ``norm`` is the gated norm (a variant may replace it, or set it to None for ``y * silu(gate)``)."""

    def __init__(self, d: Mamba2Dims, dtype: torch.dtype) -> None:
        super().__init__()
        self.d = d
        self.in_proj = ReplicatedLinear(d.hidden_size, d.intermediate + d.conv_dim + d.num_heads, d.use_bias, dtype)
        self.conv1d = CausalConv1d(d.conv_dim, d.conv_kernel, d.use_conv_bias, dtype)
        self.dt_bias = empty_param(d.num_heads, dtype=dtype)
        self.A_log = empty_param(d.num_heads, dtype=dtype)
        self.D = empty_param(d.num_heads, dtype=dtype)
        self.norm: nn.Module | None = GatedRMSNorm(d.intermediate, d.intermediate // d.n_groups, d.norm_eps, dtype)
        out_bias = d.use_bias if d.out_bias is None else d.out_bias
        self.out_proj = ReplicatedLinear(d.intermediate, d.hidden_size, out_bias, dtype)
        self.ops = current_model_ops()

    @property
    def state_shapes(self) -> list[tuple[int, ...]]:
        d = self.d
        return [(d.conv_dim, d.conv_kernel - 1), (d.num_heads, d.head_dim, d.state_size)]

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """``in_proj(x)``: gate, x|B|C and dt side by side (Falcon-H1 scales them)."""
        return self.in_proj(x)

    def mix(self, x: torch.Tensor, states: list[torch.Tensor], md: StateMetadata) -> torch.Tensor:
        d = self.d
        conv_state, ssm_state = states
        gate, xbc, dt = self.project(x).split([d.intermediate, d.conv_dim, d.num_heads], dim=-1)
        xbc = self.conv1d.run(self.ops, xbc, conv_state, md, d.activation)
        gn = d.n_groups * d.state_size
        xs, B, C = xbc.split([d.intermediate, gn, gn], dim=-1)
        t = x.shape[0]
        y = self.ops.ssd_scan(xs.reshape(t, d.num_heads, d.head_dim), dt, -torch.exp(self.A_log.float()),
                              B.reshape(t, d.n_groups, d.state_size), C.reshape(t, d.n_groups, d.state_size), self.D,
                              self.dt_bias, d.dt_limit, d.chunk_size, ssm_state, md.query_start_loc_cpu)
        y = y.reshape(t, d.intermediate).to(x.dtype)
        return self.out_proj(self.norm(y, gate) if self.norm is not None else y * F.silu(gate))


class ShortConv(MambaBase):
    """LFM2's gated short convolution: ``out_proj(C * conv(B * x))``, a causal depthwise conv of ``kernel``
    taps and no activation; its state is the last ``kernel - 1`` inputs."""

    def __init__(self, hidden_size: int, kernel: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.hidden, self.kernel = hidden_size, kernel
        self.conv = CausalConv1d(hidden_size, kernel, bias, dtype)
        self.in_proj = ReplicatedLinear(hidden_size, 3 * hidden_size, bias, dtype)
        self.out_proj = ReplicatedLinear(hidden_size, hidden_size, bias, dtype)
        self.ops = current_model_ops()

    @property
    def state_shapes(self) -> list[tuple[int, ...]]:
        return [(self.hidden, self.kernel - 1)]

    def mix(self, x: torch.Tensor, states: list[torch.Tensor], md: StateMetadata) -> torch.Tensor:
        B, C, h = self.in_proj(x).chunk(3, dim=-1)
        return self.out_proj(C * self.conv.run(self.ops, B * h, states[0], md, None))
