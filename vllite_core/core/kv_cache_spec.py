"""What each layer keeps per request (its cache spec), and how layers with equal specs form groups.

A model declares one spec per cache-holding layer, in the order of its ``kv_caches``
list. Layers with equal specs form a *group*: they share one block table per request.
Every group draws its blocks from the one block pool, so one memory budget serves all
of them. Groups are what the KV cache manager and the runner work with; a new kind of
cache is a new spec class (with ``blocks_per_request`` or a window rule) and a
manager for it in ``kv_cache_groups.py``.

Pure Python apart from the dtype's element size: the scheduler's side never touches
tensors.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from vllite_core.utils import cdiv


@dataclass(frozen=True)
class KVCacheSpec:
    """A layer's cache: ``block_size`` tokens of K and V per block, ``num_kv_heads`` x ``head_size`` each."""

    kind: ClassVar[str] = "abstract"
    # Full blocks of this kind can be found again by content hash (prefix caching).
    cacheable: ClassVar[bool] = True
    # The model's own layer reads and writes this cache (MLA latents, attention with sinks), not the platform's
    # backend: the tensor is ``[num_blocks, block_size, page_bytes / (block_size * itemsize)]``.
    model_layout: ClassVar[bool] = False

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: Any  # a torch.dtype; only its element size matters here

    @property
    def page_bytes(self) -> int:
        """Bytes one block of this layer takes (K and V)."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize

    @property
    def page_signature(self) -> tuple:
        """Layers of different groups with equal signatures can share one cache tensor (their blocks never
        overlap: one pool hands each block to one group)."""
        return (self.block_size, self.num_kv_heads, self.head_size, self.dtype)

    def max_blocks_per_request(self, max_model_len: int) -> int:
        """Blocks one request can hold at once in this group (the KV budget must fit one such request)."""
        return cdiv(max_model_len, self.block_size)


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """Causal self-attention over the whole context: one block per ``block_size`` tokens."""

    kind: ClassVar[str] = "full_attention"


@dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention (DeepSeek-V2/V3): per token one compressed latent and one shared rope key,
    ``head_size`` (kv_lora_rank + qk_rope_head_dim) values, instead of K and V for every head; ``num_kv_heads``
    is 1. A full-attention group otherwise (prefix caching, chunked prefill); the cache tensor is
    ``[num_blocks, block_size, head_size]`` and the model's attention reads it, not the platform's backend."""

    kind: ClassVar[str] = "mla"
    model_layout: ClassVar[bool] = True

    @property
    def page_bytes(self) -> int:
        return self.block_size * self.head_size * self.dtype.itemsize

    @property
    def page_signature(self) -> tuple:
        return ("mla", self.block_size, self.head_size, self.dtype)


@dataclass(frozen=True)
class SlidingWindowSpec(KVCacheSpec):
    """Self-attention over the last ``sliding_window`` positions: blocks that fell out of every future
    query's window go back to the pool."""

    kind: ClassVar[str] = "sliding_window"

    sliding_window: int = 0

    def __post_init__(self) -> None:
        if self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")

    def max_blocks_per_request(self, max_model_len: int) -> int:
        # The window's blocks plus the partly filled one at each end.
        return min(cdiv(max_model_len, self.block_size), cdiv(self.sliding_window - 1, self.block_size) + 1)


@dataclass(frozen=True)
class SinkAttentionSpec(FullAttentionSpec):
    """Full attention with a learned per-head sink logit in the softmax (gpt-oss); K and V as usual, laid out
    ``[block_size, 2, num_kv_heads, head_size]`` per block and read by the model's layer."""

    kind: ClassVar[str] = "attention_sinks"
    model_layout: ClassVar[bool] = True


@dataclass(frozen=True)
class SlidingSinkAttentionSpec(SlidingWindowSpec):
    """``SinkAttentionSpec`` over a sliding window: blocks out of every future window go back to the pool."""

    kind: ClassVar[str] = "sliding_window_sinks"
    model_layout: ClassVar[bool] = True


@dataclass(frozen=True)
class CrossAttentionSpec(KVCacheSpec):
    """Decoder cross-attention over the encoder's output: written once when the request is admitted
    (``num_encoder_tokens`` positions), never hashed or shared."""

    kind: ClassVar[str] = "cross_attention"
    cacheable: ClassVar[bool] = False

    max_encoder_len: int = 0

    def max_blocks_per_request(self, max_model_len: int) -> int:
        return cdiv(self.max_encoder_len, self.block_size)

    def blocks_per_request(self, request: Any) -> int:
        return cdiv(request.num_encoder_tokens, self.block_size)


@dataclass(frozen=True)
class StateSpec(KVCacheSpec):
    """A fixed per-request state (recurrent layers: convolution and SSM states) of ``state_bytes`` bytes,
    held in one block for the request's lifetime. It cannot be prefix-cached. ``state_shapes`` are the
    layer's state tensors (e.g. conv ``(channels, kernel - 1)`` and SSM ``(channels, state_size)``), laid
    side by side in one row of ``dtype`` per block (``vllite_core/state_cache.py``)."""

    kind: ClassVar[str] = "state"
    cacheable: ClassVar[bool] = False

    state_bytes: int = 0
    state_shapes: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def of(cls, block_size: int, state_shapes: list[tuple[int, ...]], dtype: Any) -> "StateSpec":
        """The spec of a layer keeping ``state_shapes`` tensors of ``dtype`` per request."""
        shapes = tuple(tuple(int(d) for d in s) for s in state_shapes)
        elems = sum(math.prod(s) for s in shapes)
        return cls(block_size, 0, 0, dtype, state_bytes=elems * dtype.itemsize, state_shapes=shapes)

    @property
    def page_bytes(self) -> int:
        return self.state_bytes

    @property
    def page_signature(self) -> tuple:
        return ("state", self.state_bytes)

    def max_blocks_per_request(self, max_model_len: int) -> int:
        return 1

    def blocks_per_request(self, request: Any) -> int:
        return 1


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers (indices into the model's ``kv_caches``) that share a spec and so one block table."""

    spec: KVCacheSpec
    layers: tuple[int, ...]


def group_layers(specs: list[KVCacheSpec]) -> list[KVCacheGroup]:
    """Layers with equal specs form a group; groups come in the order their first layer appears."""
    by_spec: dict[KVCacheSpec, list[int]] = {}
    for i, spec in enumerate(specs):
        by_spec.setdefault(spec, []).append(i)
    groups = [KVCacheGroup(spec, tuple(layers)) for spec, layers in by_spec.items()]
    sizes = {g.spec.block_size for g in groups}
    if len(sizes) > 1:
        raise ValueError(f"every cache group must use one block size, got {sorted(sizes)}")
    return groups


@dataclass(frozen=True)
class KVTensorPlan:
    """Which cache tensor each layer uses. Layer ``k`` of one group and layer ``k`` of another share a tensor
    when their page signatures match, so a model with two groups of ``L`` layers needs ``L`` tensors, not
    ``2L``: a block id belongs to one group at a time."""

    tensor_of_layer: tuple[int, ...]
    tensor_specs: tuple[KVCacheSpec, ...]  # the spec each tensor is allocated for

    @property
    def bytes_per_block(self) -> int:
        """Memory one block id costs across every tensor (what the KV budget is divided by)."""
        return sum(s.page_bytes for s in self.tensor_specs)


def plan_kv_tensors(groups: list[KVCacheGroup], num_layers: int) -> KVTensorPlan:
    tensor_of_layer = [-1] * num_layers
    tensor_specs: list[KVCacheSpec] = []
    slots: dict[tuple[int, tuple], int] = {}  # (position in group, page signature) -> tensor
    for group in groups:
        for pos, layer in enumerate(group.layers):
            key = (pos, group.spec.page_signature)
            if key not in slots:
                slots[key] = len(tensor_specs)
                tensor_specs.append(group.spec)
            tensor_of_layer[layer] = slots[key]
    if -1 in tensor_of_layer:
        raise ValueError(f"layer {tensor_of_layer.index(-1)} belongs to no cache group")
    return KVTensorPlan(tuple(tensor_of_layer), tuple(tensor_specs))


def attention_specs(num_layers: int, block_size: int, num_kv_heads: int, head_size: int, dtype: Any,
                    windows: list[int | None] | None = None) -> list[KVCacheSpec]:
    """The specs of a decoder's self-attention layers: full, or sliding where ``windows[i]`` is set."""
    windows = windows or [None] * num_layers
    return [SlidingWindowSpec(block_size, num_kv_heads, head_size, dtype, sliding_window=w) if w
            else FullAttentionSpec(block_size, num_kv_heads, head_size, dtype) for w in windows]
