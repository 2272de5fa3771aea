"""The paged KV cache seen from the scheduler: prefix lookups, slot allocation, freeing, over every cache group.

A model's layers form cache groups (``kv_cache_spec.py``); each group has a manager
(``kv_cache_groups.py``) and all of them draw from one ``BlockPool``. This class
coordinates them: a prefix hit is the prefix every prefix-cacheable group found,
and an allocation succeeds in every group or changes nothing. What a request holds
lives on the request (``kv_blocks``, ``num_cached_blocks``, ``block_hashes``).

The scheduler calls this every step for every running request, so the hot path
(allocate_slots for a decode) does O(1) work per group apart from the blocks it
actually allocates or caches: block hashes are computed once, as blocks fill.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable

from vllite_core.core.block_pool import BlockPool
from vllite_core.core.kv_cache_groups import make_group_manager
from vllite_core.core.kv_cache_spec import FullAttentionSpec, KVCacheGroup
from vllite_core.core.kv_cache_utils import KVCacheBlock, PrefixCacheStats, make_block_hasher

logger = logging.getLogger("vllite.kv_cache")


@dataclass
class PrefixHit:
    """A prefix-cache hit: the blocks of each group, as ``get_computed_blocks`` found them."""

    blocks: list[list[KVCacheBlock]]

    @property
    def num_blocks(self) -> int:
        return len(self.blocks[0]) if self.blocks else 0


class KVCacheManager:
    """Maps requests to KV blocks in every cache group and reuses full blocks across requests by content hash."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        max_model_len: int | None = None,
        groups: list[KVCacheGroup] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> None:
        """``num_lookahead_tokens``: slots held past every step's tokens (a draft model or EAGLE head writes
        its own drafts' KV there while proposing; speculative decoding only)."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if groups is None:  # one full-attention group (the geometry does not matter to the bookkeeping)
            groups = [KVCacheGroup(FullAttentionSpec(block_size, 1, 1, _ONE_BYTE), (0,))]
        if any(g.spec.block_size != block_size for g in groups):
            raise ValueError(f"every cache group must use block_size={block_size}")
        uncacheable = sorted({g.spec.kind for g in groups if not g.spec.cacheable})
        if enable_caching and uncacheable:
            logger.warning("prefix caching is off: %s caches cannot be prefix-cached", ", ".join(uncacheable))
            enable_caching = False
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.num_lookahead_tokens = num_lookahead_tokens
        self.groups = groups
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.managers = [make_group_manager(i, g.spec, self.block_pool, enable_caching) for i, g in enumerate(groups)]
        self._hashed = [m for m in self.managers if m.enable_caching]
        self._hasher = make_block_hasher(block_size) if enable_caching else None
        self._stats = PrefixCacheStats()

    # ---- queries -------------------------------------------------------------

    @property
    def num_usable_blocks(self) -> int:
        return self.block_pool.num_usable_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Cumulative counters since start (or the last make_prefix_cache_stats)."""
        return self._stats

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Snapshot the counters and reset them, for periodic logging."""
        snap = PrefixCacheStats(self._stats.requests, self._stats.queries, self._stats.hits)
        self._stats.reset()
        return snap

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_block_ids(self, request: Any) -> list[list[int]]:
        """The request's block table in each group."""
        return [[b.block_id for b in blocks] for blocks in request.kv_blocks] or [[] for _ in self.groups]

    # ---- scheduling API ------------------------------------------------------

    def _attach(self, request: Any) -> None:
        """First sight of a request (or after a free): one block list per group, and its hasher."""
        if len(request.kv_blocks) != len(self.managers):
            request.kv_blocks = [[] for _ in self.managers]
            request.num_cached_blocks = [0] * len(self.managers)
        if self._hasher is not None and request.block_hasher is None:
            request.set_block_hasher(self._hasher)

    def get_computed_blocks(self, request: Any) -> tuple[PrefixHit, int]:
        """Longest prefix of full blocks cached in every group, leaving at least one token to compute.

        Takes no references: pass the result straight to allocate_slots, with no
        other allocation in between (that could evict the blocks found here).
        """
        self._attach(request)
        empty = PrefixHit([[] for _ in self.managers])
        if not self.enable_caching or request.skip_prefix_cache:
            return empty, 0
        num_tokens = request.num_tokens
        # Cap so the last token is always computed (the model must produce logits).
        max_hit_blocks = (num_tokens - 1) // self.block_size if num_tokens > 0 else 0
        found = {m.group_id: m.find_cached_prefix(request.block_hashes, max_hit_blocks) for m in self._hashed}
        num_hit = min(len(h) for h in found.values())
        hit = PrefixHit([self.managers[g].trim_hits(found[g], num_hit) if g in found else []
                         for g in range(len(self.managers))])
        num_computed_tokens = num_hit * self.block_size
        self._stats.record(num_tokens, num_computed_tokens)
        return (hit, num_computed_tokens) if num_hit else (empty, 0)

    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        new_computed: PrefixHit | None = None,
        num_new_computed_tokens: int = 0,
    ) -> list[list[int]] | None:
        """Make room for the request's next ``num_new_tokens`` tokens in every group.

        Returns, per group, the ids of freshly allocated blocks (possibly empty; prefix
        hits are not included, use get_block_ids for the whole table), or None with no
        side effects on what the request holds when the pool is short: the caller
        preempts or waits. (Sliding-window blocks that no query can read any more are
        released first, whatever the outcome.)
        """
        self._attach(request)
        hits = new_computed.blocks if new_computed is not None else [[] for _ in self.managers]
        if any(hits):
            if not self.enable_caching:
                raise ValueError("prefix hits given while prefix caching is off")
            self._check_fresh(request, hits)
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_slots = num_computed + num_new_tokens
        if self.max_model_len is not None and num_slots > self.max_model_len:
            num_slots = self.max_model_len
        num_held = num_slots + self.num_lookahead_tokens  # only this step's tokens are hashed, never lookahead
        if self.max_model_len is not None and num_held > self.max_model_len:
            num_held = self.max_model_len
        for m in self.managers:
            m.release_unneeded(request, num_computed)
        need = [m.num_new_blocks(request, num_held, len(hits[m.group_id])) for m in self.managers]
        total = sum(need)
        if total or any(hits):
            # Touching a free cached block removes it from the free queue, so it
            # no longer counts as free for the fresh allocation.
            num_evictable_hits = sum(1 for h in hits for b in h if b.ref_cnt == 0 and not b.is_null)
            if total > self.block_pool.get_num_free_blocks() - num_evictable_hits:
                return None
        # Every group's hits are referenced before any group takes fresh blocks: a free cached block that is
        # one group's hit must not be evicted for another group's allocation.
        for m in self.managers:
            m.add_hits(request, hits[m.group_id])
        new_ids = [[b.block_id for b in m.add_new(request, need[m.group_id])] for m in self.managers]
        num_known = min(num_slots, request.num_tokens)
        for m in self._hashed:
            m.cache_blocks(request, num_known)
        return new_ids

    def _check_fresh(self, request: Any, hits: list[list[KVCacheBlock]]) -> None:
        for g, blocks in enumerate(hits):
            start = len(request.kv_blocks[g])
            for i, block in enumerate(blocks, start=start):
                if block.is_null:
                    continue
                if block.block_hash is None or block.block_hash != request.block_hashes[i] or block.group != g:
                    raise RuntimeError(
                        f"stale prefix hit for {request.request_id}: {block!r} was evicted between "
                        "get_computed_blocks and allocate_slots"
                    )

    def free(self, request: Any) -> None:
        """Release the request's blocks in every group, tail first, and forget them. Idempotent.

        Call it on finish, abort and preemption, BEFORE resetting
        request.num_computed_tokens: blocks cached by allocate_slots past
        num_computed_tokens (scheduled in this step, never computed because the
        request is preempted before the forward pass) are uncached here.
        """
        if len(request.kv_blocks) == len(self.managers):
            for m in self.managers:
                m.free(request)
        request.kv_blocks = []
        request.num_cached_blocks = []

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block hash; False (nothing done) while blocks are in use."""
        return self.block_pool.reset_prefix_cache()

    def check_integrity(self, requests: Iterable[Any]) -> None:
        """AssertionError unless the pool agrees with what ``requests`` (all that hold blocks) hold: reference
        counts, free + referenced = usable, every index entry on its own block, every indexed block of a
        request under that request's hash. For tests and for idle-time checks."""
        refs: dict[int, int] = {}
        group_of: dict[int, int] = {}
        for req in requests:
            for g, blocks in enumerate(req.kv_blocks):
                for i, b in enumerate(blocks):
                    if b.is_null:
                        continue
                    refs[b.block_id] = refs.get(b.block_id, 0) + 1
                    assert group_of.setdefault(b.block_id, g) == g, \
                        f"block {b.block_id} is held by groups {group_of[b.block_id]} and {g} at once"
                    if b.block_hash is not None and i < len(req.block_hashes) and self.managers[g].enable_caching:
                        assert (b.block_hash, b.group) == (req.block_hashes[i], g), \
                            f"{req.request_id}: block {i} of group {g} is indexed under another hash"
        self.block_pool.check_integrity(refs)


class _OneByte:
    itemsize = 1


_ONE_BYTE = _OneByte()
