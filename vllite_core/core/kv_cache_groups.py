"""One manager per cache group: how a kind of cache (full attention, sliding window, a fixed per-request
allocation) holds blocks for a request.

A manager keeps no per-request state of its own: a request's blocks in group ``g`` are
``request.kv_blocks[g]`` and how many of them are in the prefix-cache index is
``request.num_cached_blocks[g]``. Every manager draws from the one shared ``BlockPool``.
The ``KVCacheManager`` coordinates them so an allocation either succeeds in every
group or changes nothing.
"""
from __future__ import annotations

from typing import Any

from vllite_core.core.block_pool import BlockPool
from vllite_core.core.kv_cache_spec import CrossAttentionSpec, KVCacheSpec, SlidingWindowSpec, StateSpec
from vllite_core.core.kv_cache_utils import BlockHash, KVCacheBlock
from vllite_core.utils import cdiv


class FullAttentionManager:
    """A block per ``block_size`` tokens of context, kept until the request ends; full blocks are hashed."""

    def __init__(self, group_id: int, spec: KVCacheSpec, pool: BlockPool, enable_caching: bool) -> None:
        self.group_id = group_id
        self.spec = spec
        self.block_size = spec.block_size
        self.pool = pool
        self.enable_caching = enable_caching and spec.cacheable

    def find_cached_prefix(self, hashes: list[BlockHash], max_blocks: int) -> list[KVCacheBlock]:
        """The longest run of leading blocks found in the index (no references taken)."""
        get = self.pool.get_cached_block
        hits: list[KVCacheBlock] = []
        for i in range(max_blocks):
            block = get(hashes[i], self.group_id)
            if block is None:
                break
            hits.append(block)
        return hits

    def trim_hits(self, hits: list[KVCacheBlock], num_blocks: int) -> list[KVCacheBlock]:
        """The first ``num_blocks`` hits (the prefix every group found), as this group will hold them."""
        return hits[:num_blocks]

    def release_unneeded(self, request: Any, num_computed_tokens: int) -> None:
        """Give back blocks no future query will read (nothing, for full attention)."""

    def num_new_blocks(self, request: Any, num_slots: int, num_hits: int) -> int:
        held = len(request.kv_blocks[self.group_id])
        return max(0, cdiv(num_slots, self.block_size) - held - num_hits)

    def add_hits(self, request: Any, hits: list[KVCacheBlock]) -> None:
        """Append the prefix hits, taking references (so no group's fresh allocation can evict them)."""
        if hits:
            g = self.group_id
            self.pool.touch(hits)
            request.kv_blocks[g].extend(hits)
            # Hits are indexed already: count them as cached.
            request.num_cached_blocks[g] = max(request.num_cached_blocks[g], len(request.kv_blocks[g]))

    def add_new(self, request: Any, num_new: int) -> list[KVCacheBlock]:
        """Append ``num_new`` fresh blocks from the front of the free queue; returns them."""
        new = self.pool.get_new_blocks(num_new) if num_new else []
        request.kv_blocks[self.group_id].extend(new)
        return new

    def cache_blocks(self, request: Any, num_known_tokens: int) -> None:
        """Index the blocks that are full of known tokens and not indexed yet."""
        if not self.enable_caching:
            return
        g = self.group_id
        blocks = request.kv_blocks[g]
        num_full = min(num_known_tokens // self.block_size, len(blocks))
        num_cached = request.num_cached_blocks[g]
        if num_full > num_cached:
            self.pool.cache_full_blocks(blocks, request.block_hashes, num_cached, num_full, g)
            request.num_cached_blocks[g] = num_full

    def free(self, request: Any) -> None:
        """Release the request's blocks, tail first. Blocks indexed past what was computed (scheduled in
        a step whose forward pass never ran for it: preemption) leave the index, as their KV never came."""
        g = self.group_id
        blocks = request.kv_blocks[g]
        num_done = request.num_computed_tokens // self.block_size
        if request.num_cached_blocks[g] > num_done:
            self.pool.uncache_blocks(blocks[num_done:request.num_cached_blocks[g]])
        # Reverse: the tail is less likely to be shared, so it is evicted first.
        self.pool.free_blocks(reversed(blocks))


class SlidingWindowManager(FullAttentionManager):
    """Full attention's bookkeeping, but blocks that fell out of every future query's window go back to
    the pool at once; their place in the block table becomes the null block."""

    spec: SlidingWindowSpec

    def _num_out_of_window(self, num_computed_tokens: int) -> int:
        # The next query sits at position num_computed_tokens and reads keys from
        # num_computed_tokens - window + 1 on; leading blocks wholly before that are dead.
        return max(0, (num_computed_tokens - self.spec.sliding_window + 1) // self.block_size)

    def trim_hits(self, hits: list[KVCacheBlock], num_blocks: int) -> list[KVCacheBlock]:
        hits = hits[:num_blocks]
        dead = min(self._num_out_of_window(num_blocks * self.block_size), len(hits))
        return [self.pool.null_block] * dead + hits[dead:]

    def release_unneeded(self, request: Any, num_computed_tokens: int) -> None:
        blocks = request.kv_blocks[self.group_id]
        dead = min(self._num_out_of_window(num_computed_tokens), len(blocks))
        null = self.pool.null_block
        # Released blocks form a prefix: walk back from the last dead one to the first already null.
        i = dead - 1
        released: list[KVCacheBlock] = []
        while i >= 0 and blocks[i] is not null:
            released.append(blocks[i])
            blocks[i] = null
            i -= 1
        if released:
            self.pool.free_blocks(reversed(released))  # oldest first: evicted first


class PerRequestManager(FullAttentionManager):
    """A fixed number of blocks per request, taken when it is admitted and kept until it ends: cross
    attention (the encoder output's length) or a recurrent state (one block). Never hashed or shared."""

    spec: CrossAttentionSpec | StateSpec

    def find_cached_prefix(self, hashes: list[BlockHash], max_blocks: int) -> list[KVCacheBlock]:
        return []

    def num_new_blocks(self, request: Any, num_slots: int, num_hits: int) -> int:
        return 0 if request.kv_blocks[self.group_id] else self.spec.blocks_per_request(request)

    def cache_blocks(self, request: Any, num_known_tokens: int) -> None:
        return

    def free(self, request: Any) -> None:
        self.pool.free_blocks(reversed(request.kv_blocks[self.group_id]))


def make_group_manager(group_id: int, spec: KVCacheSpec, pool: BlockPool, enable_caching: bool
                       ) -> FullAttentionManager:
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowManager(group_id, spec, pool, enable_caching)
    if isinstance(spec, (CrossAttentionSpec, StateSpec)):
        return PerRequestManager(group_id, spec, pool, enable_caching)
    return FullAttentionManager(group_id, spec, pool, enable_caching)
