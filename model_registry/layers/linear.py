"""Linear layers: replicated, and tensor-parallel (each rank holds a slice of the weight and loads its slice).

- replicated (``ReplicatedLinear``): every rank holds the whole weight;
- column-parallel (``ColumnParallelLinear``, and its fused forms ``QKVParallelLinear`` and
  ``MergedColumnParallelLinear`` for gate/up): a rank holds some output rows; its output is its part
  of the features, used as is by the next (row-parallel) layer;
- row-parallel (``RowParallelLinear``): a rank holds the input columns matching those features;
  the partial products are summed over ranks (one all-reduce), the bias added once.

Every layer holds a quantization method (``quant_method``, ``model_registry.layers.quantization``) that owns
its weight's layout and computes the product through the platform's ops, and a ``lora`` slot the engine fills
when it serves adapters. Every parameter carries a ``weight_loader(param, tensor, shard, name)`` that copies
its rows or columns out of the full checkpoint tensor (safetensors and GGUF alike: both arrive as full tensors
with HF names). With one rank each layer is the plain layer and its loader a plain copy. The layers read this
process's rank from ``vllite_core.distributed.get_tp()`` when they are built.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from model_registry.layers.params import check_full, copy_checked, empty_param
from model_registry.layers.quantization.base import UNQUANTIZED, LinearMethod
from vllite_core.distributed import get_tp
from vllite_core.distributed.sharding import shard_heads, split
from vllite_core.lora.sharding import LoRAShard, RowSlice
from vllite_core.model_ops import ModelOps, current_model_ops

if TYPE_CHECKING:
    from vllite_core.lora.slots import LoRALayer


@dataclass(frozen=True)
class Segment:
    """Checkpoint rows ``[src_start, src_start + length)`` (of ``full``) go to local rows from ``dst_start``."""

    dst_start: int
    src_start: int
    length: int
    full: int


class LinearBase(nn.Module):
    """y = x W^T + b over this rank's slice, computed by ``quant_method``; uninitialised storage (every weight
    comes from the checkpoint). ``ops``: the platform's ops by default; a model may pin its own (plain torch
    where its tests match Hugging Face's numerics)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 ops: ModelOps | None = None) -> None:
        super().__init__()
        # This rank's (out, in) widths: what LoRA sizes its slots by, whatever ``weight`` becomes (int8
        # values, or GGUF blocks in groups of 8 rows).
        self.local_features = (out_features, in_features)
        self.weight = empty_param(out_features, in_features, dtype=dtype)
        self.bias = empty_param(out_features, dtype=dtype) if bias else None
        self.ops = ops or current_model_ops()
        self.state: dict = {}  # what the platform's op caches for this weight (packed panels), remade on change
        self.quant_method: LinearMethod = UNQUANTIZED
        self.lora: LoRALayer | None = None  # set when the engine serves adapters (each rank its slice)
        # The checkpoint tensor that filled each shard of the weight (quantization="gguf" reads it again).
        self.checkpoint_names: dict[str | None, str] = {}
        self.weight.weight_loader = self.load  # type: ignore[attr-defined]
        if self.bias is not None:
            self.bias.weight_loader = self.load  # type: ignore[attr-defined]

    def set_quant_method(self, method: LinearMethod) -> None:
        """Switch to ``method`` (its weight layout already in place); the platform's cached packing is dropped."""
        self.quant_method = method
        self.state = {}

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.quant_method.apply(self, x, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x, self.bias)
        return y if self.lora is None else self.lora(x, y)

    def lora_shard(self) -> LoRAShard:
        """The part of the full layer this rank holds (an adapter's update is cut to it): all of it."""
        return LoRAShard.whole(*self.local_features)

    @torch.no_grad()
    def load(self, param: torch.Tensor, src: torch.Tensor, shard: str | None, name: str) -> None:
        """Copy this rank's part of the full checkpoint tensor ``src`` into ``param`` (whole, when replicated)."""
        if param is self.weight:
            self.checkpoint_names[shard] = name
        copy_checked(param.data, src, name)


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank (a model's small projections, encoders, heads of their own)."""


class ColumnParallelLinear(LinearBase):
    """Output rows split over ranks; ``segments`` names the checkpoint tensors fused into it and their row
    counts (one unnamed tensor when None), each split the same way: a rank holds its part of each, in order."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 segments: dict[str | None, Segment] | None = None, ops: ModelOps | None = None,
                 out_range: tuple[int, int] | None = None) -> None:
        tp = get_tp()
        if segments is None:
            start, stop = out_range or split(out_features, tp.world_size, tp.rank)
            segments = {None: Segment(0, start, stop - start, out_features)}
        self.segments = segments
        local = sum(s.length for s in segments.values())
        super().__init__(in_features, local, bias, dtype, ops)

    def lora_shard(self) -> LoRAShard:
        """Each fused tensor's rows on this rank (the tensors follow one another in the full layer)."""
        rows, full_start = [], 0
        for seg in self.segments.values():
            rows.append(RowSlice(full_start, seg.src_start, seg.length, seg.dst_start, seg.full))
            full_start += seg.full
        return LoRAShard(self.local_features[1], 0, self.local_features[1], tuple(rows))

    @torch.no_grad()
    def load(self, param: torch.Tensor, src: torch.Tensor, shard: str | None, name: str) -> None:
        if shard is None and None not in self.segments:
            self._load_stacked(param, src, name)
            return
        if shard not in self.segments:
            raise ValueError(f"weight {name}: {type(self).__name__} has no shard {shard!r}")
        seg = self.segments[shard]
        check_full(src, 0, seg.full, name)
        if param is self.weight:
            self.checkpoint_names[shard] = name
        copy_checked(param.data[seg.dst_start:seg.dst_start + seg.length],
                     src[seg.src_start:seg.src_start + seg.length], name)

    def _load_stacked(self, param: torch.Tensor, src: torch.Tensor, name: str) -> None:
        """The named shards stacked in one checkpoint tensor, in order (Phi-3's ``qkv_proj``, a fused
        ``gate_up_proj``): this rank's part of each."""
        check_full(src, 0, sum(seg.full for seg in self.segments.values()), name)
        start = 0
        for seg in self.segments.values():
            rows = src[start + seg.src_start:start + seg.src_start + seg.length]
            copy_checked(param.data[seg.dst_start:seg.dst_start + seg.length], rows, name)
            start += seg.full


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel tensors in one matmul (gate and up): ``sizes`` maps shard -> full rows. A
    checkpoint may hold them as separate tensors (loaded by shard name) or stacked in one (``shard`` None)."""

    def __init__(self, in_features: int, sizes: dict[str, int], bias: bool, dtype: torch.dtype,
                 ops: ModelOps | None = None) -> None:
        tp = get_tp()
        segments, offset = {}, 0
        for shard, full in sizes.items():
            start, stop = split(full, tp.world_size, tp.rank)
            segments[shard] = Segment(offset, start, stop - start, full)
            offset += stop - start
        super().__init__(in_features, offset, bias, dtype, segments, ops)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v in one matmul, split by whole KV-head groups (``sharding.shard_heads``)."""

    def __init__(self, hidden_size: int, head_size: int, num_heads: int, num_kv_heads: int, bias: bool,
                 dtype: torch.dtype, ops: ModelOps | None = None) -> None:
        tp = get_tp()
        self.heads = h = shard_heads(num_heads, num_kv_heads, tp.world_size, tp.rank)
        q, kv = h.num_heads * head_size, h.num_kv_heads * head_size
        # The output projection's input columns this rank's query heads produce (its RowParallelLinear range).
        self.q_cols = (h.q_start * head_size, h.q_start * head_size + q)
        segments = {"q": Segment(0, h.q_start * head_size, q, num_heads * head_size),
                    "k": Segment(q, h.kv_start * head_size, kv, num_kv_heads * head_size),
                    "v": Segment(q + kv, h.kv_start * head_size, kv, num_kv_heads * head_size)}
        super().__init__(hidden_size, q + 2 * kv, bias, dtype, segments, ops)


class RowParallelLinear(LinearBase):
    """Input columns ``[in_start, in_stop)`` of ``in_features`` on this rank; outputs summed over ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 in_range: tuple[int, int] | None = None, ops: ModelOps | None = None) -> None:
        tp = get_tp()
        self.in_features = in_features
        self.in_range = in_range or split(in_features, tp.world_size, tp.rank)
        self.tp = tp
        super().__init__(self.in_range[1] - self.in_range[0], out_features, bias, dtype, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return super().forward(x)
        bias = self.bias if self.tp.rank == 0 else None  # added once to the sum
        y = self._matmul(x, bias)
        if self.lora is not None:  # this rank's columns of lora_A: the partial updates sum like the products
            y = self.lora(x, y)
        return self.tp.communicator.all_reduce(y)

    def lora_shard(self) -> LoRAShard:
        out = self.local_features[0]
        return LoRAShard(self.in_features, *self.in_range, (RowSlice(0, 0, out, 0, out),))

    @torch.no_grad()
    def load(self, param: torch.Tensor, src: torch.Tensor, shard: str | None, name: str) -> None:
        if param is self.bias:
            copy_checked(param.data, src, name)
            return
        check_full(src, 1, self.in_features, name)
        self.checkpoint_names[None] = name
        copy_checked(param.data, src[:, self.in_range[0]:self.in_range[1]], name)
