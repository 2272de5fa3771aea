"""How an adapter's checkpoint-shaped update lands on one tensor-parallel rank.

A PEFT adapter is saved for the whole model: ``lora_A`` [r, in] and ``lora_B`` [out, r] of each
projection, in checkpoint coordinates. A rank holds a slice of each linear layer: a column-parallel
layer some output rows of each tensor fused into it (``lora_B`` is cut the same way), a row-parallel
layer some input columns (``lora_A`` is cut; each rank's partial update is summed by the layer's own
all-reduce, as its partial product is). Each layer says which part it holds (``LoRAShard``, from its
``lora_shard()``); this module turns that into the full layout adapters are checked against and into
one rank's updates. With one rank every slice is whole and the updates are the adapter's own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from vllite_core.lora.adapter import LoRAAdapter, ModuleUpdate


@dataclass(frozen=True)
class RowSlice:
    """Rows of one checkpoint tensor fused into a layer: its ``full`` rows start at ``full_start`` in the whole
    fused layer; this rank holds rows ``src_start:src_start + length`` of it, at local rows from ``dst_start``."""

    full_start: int
    src_start: int
    length: int
    dst_start: int
    full: int


@dataclass(frozen=True)
class LoRAShard:
    """The part of a linear layer one rank holds: input columns ``in_start:in_stop`` of ``in_features``
    and the output rows of each fused tensor (``rows``)."""

    in_features: int
    in_start: int
    in_stop: int
    rows: tuple[RowSlice, ...]

    @classmethod
    def whole(cls, out_features: int, in_features: int) -> LoRAShard:
        return cls(in_features, 0, in_features, (RowSlice(0, 0, out_features, 0, out_features),))


@runtime_checkable
class ShardedLinear(Protocol):
    """A linear layer of model_registry: it knows which part of the full layer this rank holds."""

    def lora_shard(self) -> LoRAShard: ...


def shard_of(module: Any) -> LoRAShard:
    """A layer's part on this rank; a plain ``nn.Linear`` is whole."""
    if isinstance(module, ShardedLinear):
        return module.lora_shard()
    out_f, in_f = module.weight.shape
    return LoRAShard.whole(int(out_f), int(in_f))


Layout = tuple[dict[str, tuple[str, int, int]], dict[str, int]]


def model_shards(model: Any) -> dict[str, LoRAShard]:
    """Each adaptable engine layer's part on this rank."""
    modules = dict(model.named_modules())
    return {eng: shard_of(modules[eng]) for eng, _, _ in model.lora_targets().values()}


def full_layout(model: Any) -> Layout:
    """(targets, in_features) in checkpoint coordinates, whatever rank asks: each HF projection -> (engine
    layer, its rows in the whole fused layer), each engine layer's whole input width. Adapters are checked
    (and loaded) against it on every rank and in the API process."""
    shards = model_shards(model)
    targets: dict[str, tuple[str, int, int]] = {}
    for hf, (eng, start, end) in model.lora_targets().items():
        targets[hf] = (eng, *_full_rows(shards[eng], start, end))
    return targets, {eng: s.in_features for eng, s in shards.items()}


def _full_rows(shard: LoRAShard, start: int, end: int) -> tuple[int, int]:
    for rs in shard.rows:
        if rs.dst_start == start and rs.dst_start + rs.length == end:  # one whole fused tensor
            return rs.full_start, rs.full_start + rs.full
    for rs in shard.rows:  # part of an unsharded tensor: local rows are full rows
        if rs.dst_start <= start and end <= rs.dst_start + rs.length and rs.length == rs.full:
            off = rs.full_start - rs.dst_start
            return start + off, end + off
    if start == 0 and end == sum(rs.length for rs in shard.rows):  # the whole layer: its tensors stacked as
        return 0, sum(rs.full for rs in shard.rows)  # one checkpoint tensor (Phi-3's qkv_proj, a gate_up_proj)
    raise ValueError(f"LoRA target rows [{start}, {end}) match no tensor of the layer ({shard.rows})")


def shard_adapter(adapter: LoRAAdapter, shards: dict[str, LoRAShard]) -> LoRAAdapter:
    """This rank's part of an adapter loaded in checkpoint coordinates (``full_layout``)."""
    out = LoRAAdapter(adapter.name, adapter.int_id, adapter.path, adapter.rank, adapter.content_hash)
    for eng, ups in adapter.modules.items():
        shard = shards[eng]
        local: list[ModuleUpdate] = []
        for u in ups:
            a = u.lora_a[:, shard.in_start:shard.in_stop].contiguous()
            for rs in shard.rows:
                held = rs.full_start + rs.src_start
                lo, hi = max(u.out_start, held), min(u.out_end, held + rs.length)
                if lo >= hi:
                    continue
                dst = rs.dst_start + lo - held
                local.append(ModuleUpdate(dst, dst + hi - lo, a,
                                          u.lora_b[lo - u.out_start:hi - u.out_start].contiguous()))
        if local:
            local.sort(key=lambda m: m.out_start)
            out.modules[eng] = local
    return out

