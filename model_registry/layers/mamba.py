"""State-space and convolution mixers: layers whose per-request memory is a fixed state, not a KV cache.

Each mixer (a ``MambaBase``) declares its state tensors (``state_shapes``: a convolution state of the last
``kernel - 1`` inputs, and an SSM state), one ``StateSpec`` per layer (``vllite_core/state_cache.py``). The
step's tokens arrive flattened; the causal conv and the scans run through the platform's model ops, which
carry each request's state across prefill chunks and decode steps.

- ``MambaMixer``: Mamba-1's selective scan (Mamba, FalconMamba, Jamba), tensor-parallel over its channels;
- ``Mamba2Mixer``: Mamba-2's SSD scan (Mamba2 and the hybrids built on it), geometry in ``Mamba2Dims``,
  tensor-parallel over whole heads (``mamba2_shard``);
- ``ShortConv``: a gated short convolution (LFM2), tensor-parallel over its channels.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model_registry.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
    Segment,
)
from model_registry.layers.norm import RMSNorm, rms_normalize
from model_registry.layers.params import row_ranges_param, rows_param
from vllite_core.config import ConfigError
from vllite_core.core.kv_cache_spec import StateSpec
from vllite_core.distributed import get_tp
from vllite_core.distributed.sharding import split
from vllite_core.model_ops import ModelOps, current_model_ops
from vllite_core.state_cache import StateMetadata, gather_states, scatter_states


class CausalConv1d(nn.Module):
    """A depthwise causal conv (weights in the checkpoint's layout, [channels, 1, kernel]) that continues each
    request from its conv state: ``ModelOps.causal_conv1d``. ``rows``: the channel ranges this rank holds, in
    order (all of them by default)."""

    def __init__(self, channels: int, kernel: int, bias: bool, dtype: torch.dtype,
                 rows: Sequence[tuple[int, int]] | None = None) -> None:
        super().__init__()
        rows = rows or [(0, channels)]
        self.weight = row_ranges_param(rows, channels, 1, kernel, dtype=dtype)
        self.bias = row_ranges_param(rows, channels, dtype=dtype) if bias else None

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
        self.conv1d = CausalConv1d(full, self.kernel, bool(c.use_conv_bias), dtype, [rows])
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


def check_mamba2_split(num_heads: int, n_groups: int, tensor_parallel_size: int) -> None:
    """ConfigError naming ``tensor_parallel_size`` unless a Mamba-2 mixer splits: whole heads per rank, and
    whole groups per rank or whole ranks per group (vLLM's rule)."""
    tp = tensor_parallel_size
    if num_heads % tp or (n_groups % tp and tp % n_groups):
        raise ConfigError(f"tensor_parallel_size: {tp} ranks cannot split a Mamba-2 mixer of {num_heads} heads in "
                          f"{n_groups} group(s): the ranks must divide the heads, and divide or be a multiple of "
                          "the groups")


@dataclass(frozen=True)
class Mamba2Shard:
    """A tensor-parallel rank's part of a Mamba-2 mixer: whole heads (their x, gate, dt, A, D, norm and
    out_proj channels) and the B/C groups those heads read (a group shared by several ranks is whole on each)."""

    heads: tuple[int, int]
    groups: tuple[int, int]


def mamba2_shard(num_heads: int, n_groups: int, tensor_parallel_size: int, rank: int) -> Mamba2Shard:
    check_mamba2_split(num_heads, n_groups, tensor_parallel_size)
    per_rank = num_heads // tensor_parallel_size
    if n_groups % tensor_parallel_size == 0:
        g = n_groups // tensor_parallel_size
        groups = (rank * g, (rank + 1) * g)
    else:  # tensor_parallel_size // n_groups ranks share each group
        g0 = rank // (tensor_parallel_size // n_groups)
        groups = (g0, g0 + 1)
    return Mamba2Shard((rank * per_rank, (rank + 1) * per_rank), groups)


class GatedRMSNorm(nn.Module):
    """RMS norm of ``x * silu(gate)`` over groups of ``group_size`` channels, in float32, then scaled. ``rows``:
    this rank's channels of the ``size``; a rank holding part of one group sums its squares with the others'.
    Falcon-H1's form (``float32_weight``): the weight applied before the cast, and the gate after the norm
    instead of before it when ``norm_before_gate``."""

    def __init__(self, size: int, group_size: int, eps: float, dtype: torch.dtype,
                 rows: tuple[int, int] | None = None, float32_weight: bool = False,
                 norm_before_gate: bool = False) -> None:
        super().__init__()
        rows = rows or (0, size)
        self.weight = rows_param(rows, size, dtype=dtype)
        self.group_size = group_size
        self.eps = eps
        self.float32_weight, self.norm_before_gate = float32_weight, norm_before_gate
        # (this rank's group, groups in all) when the rank holds only part of its group
        self.split_group = None if (rows[1] - rows[0]) % group_size == 0 else (rows[0] // group_size,
                                                                               size // group_size)

    def normalize(self, h: torch.Tensor) -> torch.Tensor:
        """``h`` (float32) divided by the RMS of each group."""
        if self.split_group is not None:
            g, n = self.split_group
            sums = h.new_zeros(h.shape[0], n)  # one column per group: ranks of other groups add zeros to it
            sums[:, g] = h.pow(2).sum(-1)
            get_tp().communicator.all_reduce(sums)
            return h * torch.rsqrt(sums[:, g:g + 1] / self.group_size + self.eps)
        g = h.view(*h.shape[:-1], -1, self.group_size)
        return (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)).view(h.shape)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        if not self.norm_before_gate:
            h = h * F.silu(gate.float())
        h = self.normalize(h)
        if not self.float32_weight:
            return self.weight * h.to(self.weight.dtype)
        h = self.weight * h
        return (h * F.silu(gate.float()) if self.norm_before_gate else h).to(x.dtype)


class Mamba2Mixer(MambaBase):
    """Mamba-2: in_proj to (gate, x|B|C, dt), the causal conv over x|B|C, the SSD scan, a gated norm, out_proj.
    ``norm`` is the gated norm (a variant may replace it, or set it to None for ``y * silu(gate)``).
    Tensor-parallel over whole heads (``mamba2_shard``): each rank's in_proj rows, conv channels, A, D, dt
    bias and norm weights are its heads' and groups'; out_proj sums over the ranks (one all-reduce per mixer,
    plus one of the norm's squares when a group spans ranks). Each rank's state holds its heads."""

    def __init__(self, d: Mamba2Dims, dtype: torch.dtype) -> None:
        super().__init__()
        self.d = d
        tp = get_tp()
        sh = mamba2_shard(d.num_heads, d.n_groups, tp.world_size, tp.rank)
        (h0, h1), (g0, g1) = sh.heads, sh.groups
        hd, n, full, gn = d.head_dim, d.state_size, d.intermediate, d.n_groups * d.state_size
        self.heads, self.groups = h1 - h0, g1 - g0
        self.inner = self.heads * hd  # this rank's channels of x, the gate and the norm
        self.bc = self.groups * n  # this rank's columns of B (and of C)
        self.conv_channels = self.inner + 2 * self.bc
        self.channels = chans = (h0 * hd, h1 * hd)  # this rank's of x, the gate, the norm and out_proj's input
        segments, dst = {}, 0
        for name, src, length, whole in (("gate", chans[0], self.inner, full), ("x", chans[0], self.inner, full),
                                         ("B", g0 * n, self.bc, gn), ("C", g0 * n, self.bc, gn),
                                         ("dt", h0, self.heads, d.num_heads)):
            segments[name] = Segment(dst, src, length, whole)
            dst += length
        self.in_proj = ColumnParallelLinear(d.hidden_size, dst, d.use_bias, dtype, segments)
        self.conv1d = CausalConv1d(d.conv_dim, d.conv_kernel, d.use_conv_bias, dtype,
                                   [chans, (full + g0 * n, full + g1 * n), (full + gn + g0 * n, full + gn + g1 * n)])
        self.dt_bias = rows_param(sh.heads, d.num_heads, dtype=dtype)
        self.A_log = rows_param(sh.heads, d.num_heads, dtype=dtype)
        self.D = rows_param(sh.heads, d.num_heads, dtype=dtype)
        self.norm: nn.Module | None = GatedRMSNorm(full, full // d.n_groups, d.norm_eps, dtype, chans)
        out_bias = d.use_bias if d.out_bias is None else d.out_bias
        self.out_proj = RowParallelLinear(full, d.hidden_size, out_bias, dtype, chans)
        self.ops = current_model_ops()

    @property
    def state_shapes(self) -> list[tuple[int, ...]]:
        d = self.d
        return [(self.conv_channels, d.conv_kernel - 1), (self.heads, d.head_dim, d.state_size)]

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """``in_proj(x)``: gate, x|B|C and dt side by side (Falcon-H1 scales them)."""
        return self.in_proj(x)

    def mix(self, x: torch.Tensor, states: list[torch.Tensor], md: StateMetadata) -> torch.Tensor:
        d = self.d
        conv_state, ssm_state = states
        gate, xbc, dt = self.project(x).split([self.inner, self.conv_channels, self.heads], dim=-1)
        xbc = self.conv1d.run(self.ops, xbc, conv_state, md, d.activation)
        xs, B, C = xbc.split([self.inner, self.bc, self.bc], dim=-1)
        t = x.shape[0]
        y = self.ops.ssd_scan(xs.reshape(t, self.heads, d.head_dim), dt, -torch.exp(self.A_log.float()),
                              B.reshape(t, self.groups, d.state_size), C.reshape(t, self.groups, d.state_size),
                              self.D, self.dt_bias, d.dt_limit, d.chunk_size, ssm_state, md.query_start_loc_cpu)
        y = y.reshape(t, self.inner).to(x.dtype)
        return self.out_proj(self.norm(y, gate) if self.norm is not None else y * F.silu(gate))


class ShortConv(MambaBase):
    """LFM2's gated short convolution: ``out_proj(C * conv(B * x))``, a causal depthwise conv of ``kernel``
    taps and no activation; its state is the last ``kernel - 1`` inputs. Tensor-parallel over its channels:
    each rank holds its rows of B, C and x (``in_proj`` stacks the three), of the conv and of its state, and
    ``out_proj`` sums over the ranks."""

    def __init__(self, hidden_size: int, kernel: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        tp = get_tp()
        rows = split(hidden_size, tp.world_size, tp.rank)
        self.hidden, self.kernel = rows[1] - rows[0], kernel  # this rank's channels
        self.conv = CausalConv1d(hidden_size, kernel, bias, dtype, [rows])
        self.in_proj = ColumnParallelLinear(hidden_size, 3 * self.hidden, bias, dtype, {
            name: Segment(i * self.hidden, rows[0], self.hidden, hidden_size) for i, name in enumerate("BCx")})
        self.out_proj = RowParallelLinear(hidden_size, hidden_size, bias, dtype, rows)
        self.ops = current_model_ops()

    @property
    def state_shapes(self) -> list[tuple[int, ...]]:
        return [(self.hidden, self.kernel - 1)]

    def mix(self, x: torch.Tensor, states: list[torch.Tensor], md: StateMetadata) -> torch.Tensor:
        B, C, h = self.in_proj(x).chunk(3, dim=-1)
        return self.out_proj(C * self.conv.run(self.ops, B * h, states[0], md, None))
