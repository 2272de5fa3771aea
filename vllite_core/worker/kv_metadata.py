"""One metadata builder per KV cache spec kind: what a cache group's block table, cache tensors and step
metadata look like.

The runner asks ``builder_for(spec)`` and never branches on the kind: a new kind of cache is a new
``MetadataBuilder`` registered here for its spec class (``register_builder``). Builders read the step's
layout (``StepLayout``: which rows run, their positions and lengths) and the persistent batch's block
table of their group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from vllite_core.attention import AttentionBackend, AttentionMetadata
from vllite_core.core.kv_cache_spec import (
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    StateSpec,
)
from vllite_core.state_cache import build_state_metadata, state_tensor_shape
from vllite_core.utils import cdiv


@dataclass
class StepLayout:
    """The flattened step: scheduled batch rows (ascending) and, per row, tokens computed before the step,
    tokens scheduled and first input index; per token, its row index (into ``rows``) and position."""

    rows: np.ndarray
    computed: np.ndarray
    num_sched: np.ndarray
    query_start_loc: np.ndarray  # len(rows) + 1
    req_idx: np.ndarray
    positions: np.ndarray
    seq_lens: np.ndarray
    max_query_len: int
    total: int


def attention_metadata(backend: AttentionBackend, device: torch.device, block_size: int,
                       query_start_loc: np.ndarray, seq_lens: np.ndarray, block_table: np.ndarray,
                       slot_mapping: np.ndarray, max_query_len: int, num_tokens: int,
                       prepare: bool = True) -> AttentionMetadata:
    """Paged-attention metadata on ``device`` (and the backend's own preparation of it, unless ``prepare`` is
    False: a cross-attention group stores nothing). Model-based proposers build theirs with it too."""
    md = AttentionMetadata(
        num_actual_tokens=num_tokens,
        query_start_loc=torch.as_tensor(query_start_loc.astype(np.int32), device=device),
        seq_lens=torch.as_tensor(seq_lens.astype(np.int32), device=device),
        block_table=torch.as_tensor(np.ascontiguousarray(block_table, dtype=np.int32), device=device),
        slot_mapping=torch.as_tensor(slot_mapping.astype(np.int64), device=device),
        max_query_len=int(max_query_len), max_seq_len=int(seq_lens.max()), block_size=block_size,
        query_start_loc_cpu=query_start_loc.tolist(), seq_lens_cpu=seq_lens.tolist())
    if prepare:
        backend.prepare(md)
    return md


@dataclass
class BuildContext:
    """What every builder reads beside the step: the backend, the device, the block size."""

    backend: AttentionBackend
    device: torch.device
    block_size: int
    max_model_len: int


class MetadataBuilder(Protocol):
    def table_width(self, spec: Any, ctx: BuildContext) -> int:
        """Block-table columns a request of this group needs."""

    def tensor_shape(self, spec: Any, num_blocks: int, ctx: BuildContext) -> tuple[int, ...]:
        """One cache tensor of this kind."""

    def build(self, spec: Any, table: np.ndarray, step: StepLayout, batch: Any, ctx: BuildContext) -> Any:
        """This step's metadata of a group (``table``: the group's block table of the whole batch)."""

    def profile(self, spec: Any, table: np.ndarray, n: int, ctx: BuildContext) -> Any:
        """The metadata of one ``n``-token prompt in ``table`` (the profile run)."""


class AttentionBuilder:
    """Self-attention over the request's own tokens: slots of the scheduled positions."""

    def table_width(self, spec: KVCacheSpec, ctx: BuildContext) -> int:
        return spec.max_blocks_per_request(ctx.max_model_len)

    def tensor_shape(self, spec: KVCacheSpec, num_blocks: int, ctx: BuildContext) -> tuple[int, ...]:
        if spec.model_layout:  # read by the model's own layer (MLA latents, attention with sinks), not the backend
            return (num_blocks, ctx.block_size, spec.page_bytes // (ctx.block_size * spec.dtype.itemsize))
        return ctx.backend.get_kv_cache_shape(num_blocks, ctx.block_size, spec.num_kv_heads, spec.head_size)

    def build(self, spec: KVCacheSpec, table: np.ndarray, step: StepLayout, batch: Any,
              ctx: BuildContext) -> AttentionMetadata:
        bs = ctx.block_size
        table = table[step.rows, :cdiv(int(step.seq_lens.max()), bs)]
        slots = table[step.req_idx, step.positions // bs].astype(np.int64) * bs + step.positions % bs
        return attention_metadata(ctx.backend, ctx.device, bs, step.query_start_loc, step.seq_lens, table, slots,
                                  step.max_query_len, step.total)

    def profile(self, spec: KVCacheSpec, table: np.ndarray, n: int, ctx: BuildContext) -> AttentionMetadata:
        bs = ctx.block_size
        pos = np.arange(n)
        return attention_metadata(ctx.backend, ctx.device, bs, np.array([0, n]), np.array([n]), table,
                                  table[0, pos // bs].astype(np.int64) * bs + pos % bs, n, n)


class SlidingWindowBuilder(AttentionBuilder):
    """Its table keeps the dead slots (as the null block): a whole context's columns."""

    def table_width(self, spec: KVCacheSpec, ctx: BuildContext) -> int:
        return cdiv(ctx.max_model_len, ctx.block_size)


class CrossAttentionBuilder(AttentionBuilder):
    """Queries attend to the whole encoder output, written at admission: nothing to store in the step."""

    def build(self, spec: KVCacheSpec, table: np.ndarray, step: StepLayout, batch: Any,
              ctx: BuildContext) -> AttentionMetadata:
        enc_lens = batch.num_encoder_tokens[step.rows]
        table = table[step.rows, :max(1, cdiv(int(enc_lens.max()), ctx.block_size))]
        return attention_metadata(ctx.backend, ctx.device, ctx.block_size, step.query_start_loc, enc_lens, table,
                                  np.zeros(0, dtype=np.int64), step.max_query_len, step.total, prepare=False)


class StateBuilder:
    """One block per request: its recurrent state (``vllite_core/state_cache.py``)."""

    def table_width(self, spec: StateSpec, ctx: BuildContext) -> int:
        return spec.max_blocks_per_request(ctx.max_model_len)

    def tensor_shape(self, spec: StateSpec, num_blocks: int, ctx: BuildContext) -> tuple[int, ...]:
        return state_tensor_shape(spec, num_blocks)

    def build(self, spec: StateSpec, table: np.ndarray, step: StepLayout, batch: Any, ctx: BuildContext) -> Any:
        return build_state_metadata(table[step.rows, 0], step.computed, step.query_start_loc, step.max_query_len,
                                    step.total, ctx.device)

    def profile(self, spec: StateSpec, table: np.ndarray, n: int, ctx: BuildContext) -> Any:
        return build_state_metadata(np.array([1]), np.array([0]), np.array([0, n]), n, n, ctx.device)


_BUILDERS: dict[type, MetadataBuilder] = {
    FullAttentionSpec: AttentionBuilder(),
    SlidingWindowSpec: SlidingWindowBuilder(),
    CrossAttentionSpec: CrossAttentionBuilder(),
    StateSpec: StateBuilder(),
}


def register_builder(spec_cls: type, builder: MetadataBuilder) -> None:
    """A new kind of cache: its spec class and the builder of its metadata."""
    _BUILDERS[spec_cls] = builder


def builder_for(spec: KVCacheSpec) -> MetadataBuilder:
    for cls in type(spec).__mro__:
        if cls in _BUILDERS:
            return _BUILDERS[cls]
    raise TypeError(f"no metadata builder for KV cache spec {type(spec).__name__} (register_builder)")
