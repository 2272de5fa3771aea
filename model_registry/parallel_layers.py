"""Tensor-parallel layers: each rank holds a slice of a weight and loads its slice of the checkpoint.

- column-parallel (``ColumnParallelLinear``, and its fused forms ``QKVParallelLinear`` and
  ``MergedColumnParallelLinear`` for gate/up): a rank holds some output rows; its output is its part
  of the features, used as is by the next (row-parallel) layer;
- row-parallel (``RowParallelLinear``): a rank holds the input columns matching those features;
  the partial products are summed over ranks (one all-reduce), the bias added once;
- the vocabulary (``vocab_embedding``, ``gather_logits``): each rank holds a block of token rows;
  lookups of other ranks' tokens give zeros and the all-reduce fills them in; the LM head's logits
  are gathered.

Every sharded parameter carries a ``weight_loader(param, tensor, shard, name)`` that copies its rows or
columns out of the full checkpoint tensor (safetensors and GGUF alike: both arrive as full tensors
with HF names). With one rank each layer is the plain layer and its loader a plain copy.
The layers read this process's rank from ``vllite_core.distributed.get_tp()`` when they are built.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vllite_core.distributed import get_tp
from vllite_core.distributed.sharding import VocabShard, shard_heads, shard_vocab, split
from vllite_core.model_ops import ModelOps, current_model_ops


@torch.no_grad()
def copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"weight {name}: checkpoint shape {tuple(src.shape)} does not match the model's "
                         f"{tuple(dst.shape)}")
    dst.copy_(src)


def _check_full(src: torch.Tensor, dim: int, full: int, name: str) -> None:
    if src.dim() <= dim or src.shape[dim] != full:
        raise ValueError(f"weight {name}: checkpoint shape {tuple(src.shape)} does not have {full} rows/columns "
                         f"along dimension {dim} as the model expects")


@dataclass(frozen=True)
class Segment:
    """Checkpoint rows ``[src_start, src_start + length)`` (of ``full``) go to local rows from ``dst_start``."""

    dst_start: int
    src_start: int
    length: int
    full: int


class ParallelLinear(nn.Module):
    """y = x W^T + b over this rank's slice; uninitialised storage (every weight comes from the checkpoint)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 ops: ModelOps | None = None) -> None:
        super().__init__()
        # This rank's (out, in) widths: what LoRA sizes its slots by, whatever ``weight`` becomes (int8
        # values, or GGUF blocks in groups of 8 rows).
        self.local_features = (out_features, in_features)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self._ops = ops or current_model_ops()  # a model may pin its own (Whisper: plain torch)
        self._state: dict = {}
        self.lora = None  # a vllite_core.lora.slots.LoRALayer when the engine serves adapters (one rank only)
        self.weight_scale: torch.Tensor | None = None  # float32 [out] once quantize_int8() has run
        self.gguf_weight = None  # a vllite_core.quantization.GGUFWeight once use_gguf_weight() has run
        # The checkpoint tensor that filled each shard of the weight (quantization="gguf" reads it again).
        self.checkpoint_names: dict[str | None, str] = {}
        self.weight.weight_loader = self.load  # type: ignore[attr-defined]
        if self.bias is not None:
            self.bias.weight_loader = self.load  # type: ignore[attr-defined]

    def quantize_int8(self) -> None:
        """Replace this rank's weight by int8 values and a scale per output row (``quantization="int8"``)."""
        from vllite_core.quantization import quantize_rows_int8

        q, self.weight_scale = quantize_rows_int8(self.weight.data)
        self.weight = nn.Parameter(q, requires_grad=False)
        self._state = {}

    def use_gguf_weight(self, w) -> None:
        """Compute from GGUF blocks (``quantization="gguf"``) and drop the float weight: ``weight`` becomes
        the packed blocks (``GGUFWeight.blocks``: groups of 8 output features)."""
        self.gguf_weight = w
        self.weight = nn.Parameter(w.blocks, requires_grad=False)
        self._state = {}

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.gguf_weight is not None:
            return self._ops.gguf_linear(x, self.gguf_weight, bias, self._state)
        if self.weight_scale is None:
            return self._ops.linear(x, self.weight, bias, self._state)
        return self._ops.int8_linear(x, self.weight, self.weight_scale, bias, self._state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x, self.bias)
        return y if self.lora is None else self.lora(x, y)

    def load(self, param: torch.Tensor, src: torch.Tensor, shard: str | None, name: str) -> None:
        raise NotImplementedError


class ColumnParallelLinear(ParallelLinear):
    """Output rows split over ranks; ``shards`` names the checkpoint tensors fused into it and their row
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

    @torch.no_grad()
    def load(self, param: torch.Tensor, src: torch.Tensor, shard: str | None, name: str) -> None:
        if shard not in self.segments:
            raise ValueError(f"weight {name}: {type(self).__name__} has no shard {shard!r}")
        seg = self.segments[shard]
        _check_full(src, 0, seg.full, name)
        if param is self.weight:
            self.checkpoint_names[shard] = name
        copy_checked(param.data[seg.dst_start:seg.dst_start + seg.length],
                     src[seg.src_start:seg.src_start + seg.length], name)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel tensors in one matmul (gate and up): ``sizes`` maps shard -> full rows."""

    def __init__(self, in_features: int, sizes: dict[str, int], bias: bool, dtype: torch.dtype) -> None:
        tp = get_tp()
        segments, offset = {}, 0
        for shard, full in sizes.items():
            start, stop = split(full, tp.world_size, tp.rank)
            segments[shard] = Segment(offset, start, stop - start, full)
            offset += stop - start
        super().__init__(in_features, offset, bias, dtype, segments)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v in one matmul, split by whole KV-head groups (``sharding.shard_heads``)."""

    def __init__(self, hidden_size: int, head_size: int, num_heads: int, num_kv_heads: int, bias: bool,
                 dtype: torch.dtype) -> None:
        tp = get_tp()
        self.heads = h = shard_heads(num_heads, num_kv_heads, tp.world_size, tp.rank)
        q, kv = h.num_heads * head_size, h.num_kv_heads * head_size
        segments = {"q": Segment(0, h.q_start * head_size, q, num_heads * head_size),
                    "k": Segment(q, h.kv_start * head_size, kv, num_kv_heads * head_size),
                    "v": Segment(q + kv, h.kv_start * head_size, kv, num_kv_heads * head_size)}
        super().__init__(hidden_size, q + 2 * kv, bias, dtype, segments)


class RowParallelLinear(ParallelLinear):
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
        return self.tp.communicator.all_reduce(self._matmul(x, bias))

    @torch.no_grad()
    def load(self, param: torch.Tensor, src: torch.Tensor, shard: str | None, name: str) -> None:
        if param is self.bias:
            copy_checked(param.data, src, name)
            return
        _check_full(src, 1, self.in_features, name)
        self.checkpoint_names[None] = name
        copy_checked(param.data, src[:, self.in_range[0]:self.in_range[1]], name)


# ---- the vocabulary ---------------------------------------------------------------------------------

def vocab_parameter(vocab_size: int, hidden_size: int, dtype: torch.dtype) -> tuple[nn.Parameter, VocabShard]:
    """This rank's block of an embedding / LM-head matrix (padded rows zero) and where it sits."""
    tp = get_tp()
    shard = shard_vocab(vocab_size, tp.world_size, tp.rank)
    param = nn.Parameter(torch.empty(shard.padded, hidden_size, dtype=dtype), requires_grad=False)

    @torch.no_grad()
    def load(p: torch.Tensor, src: torch.Tensor, _shard: str | None, name: str) -> None:
        _check_full(src, 0, vocab_size, name)
        n = shard.stop - shard.start
        copy_checked(p.data[:n], src[shard.start:shard.stop], name)
        p.data[n:].zero_()

    param.weight_loader = load  # type: ignore[attr-defined]
    return param, shard


def vocab_embedding(input_ids: torch.Tensor, weight: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """Embedding rows of ``input_ids``: this rank's rows, zeros elsewhere, summed over ranks (exact)."""
    if shard.is_whole:
        return F.embedding(input_ids, weight)
    inside = (input_ids >= shard.start) & (input_ids < shard.stop)
    x = F.embedding(torch.where(inside, input_ids - shard.start, 0), weight)
    x.masked_fill_(~inside.unsqueeze(-1), 0)
    return get_tp().communicator.all_reduce(x)


def gather_logits(local: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """Logits over the whole vocabulary from every rank's block (the padding dropped)."""
    if shard.is_whole:
        return local
    return get_tp().communicator.all_gather(local, dim=-1)[..., :shard.vocab_size]


def load_parameter(param: torch.Tensor, src: torch.Tensor, shard: str | None, name: str) -> None:
    """Fill ``param`` from a full checkpoint tensor: its ``weight_loader`` slices this rank's part."""
    loader = getattr(param, "weight_loader", None)
    if loader is None:
        copy_checked(param.data, src, name)
    else:
        loader(param, src, shard, name)
