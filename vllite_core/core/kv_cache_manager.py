"""Per-request view of the paged KV cache: prefix lookups, slot allocation, freeing.

The scheduler calls this every step for every running request, so the hot path
(allocate_slots for a decode) does O(1) work apart from the blocks it actually
allocates or caches: block hashes are computed once, incrementally, as blocks fill.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from vllite_core.core.block_pool import BlockPool
from vllite_core.core.kv_cache_utils import (
    BlockHash,
    KVCacheBlock,
    PrefixCacheStats,
    hash_block_tokens,
)


class KVCacheRequest(Protocol):
    """What the manager reads from a request (the engine's Request provides it)."""

    request_id: str
    all_token_ids: Sequence[int]  # prompt then outputs so far; append-only
    num_tokens: int
    num_prompt_tokens: int
    num_computed_tokens: int  # tokens whose KV is already in the request's blocks
    block_extra_keys: tuple  # mixed into every block hash (e.g. a LoRA id)
    skip_prefix_cache: bool  # prompt logprobs: never read the cache (still writes)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Maps requests to KV blocks and reuses full blocks across requests by content hash."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        max_model_len: int | None = None,
        num_cross_blocks: int = 0,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Hashes of the request's full blocks computed so far (a prefix of its blocks).
        self.req_to_block_hashes: dict[str, list[BlockHash]] = {}
        # How many leading blocks of the request are already indexed in the pool.
        self.num_cached_block: dict[str, int] = {}
        self._stats = PrefixCacheStats()
        # Encoder-decoder models: cross-attention K/V, written once per request from the
        # encoder output, live in their own pool (never hashed, never shared).
        self.cross_pool = BlockPool(num_cross_blocks, enable_caching=False) if num_cross_blocks else None
        self.req_to_cross_blocks: dict[str, list[KVCacheBlock]] = {}

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

    def allocate_cross(self, request_id: str, num_encoder_tokens: int) -> list[int] | None:
        """Blocks for a request's encoder K/V (once per admission); None if the cross pool is short."""
        if request_id in self.req_to_cross_blocks:
            return [b.block_id for b in self.req_to_cross_blocks[request_id]]
        if self.cross_pool is None:
            raise RuntimeError("this engine has no cross-attention cache (not an encoder-decoder model)")
        n = cdiv(num_encoder_tokens, self.block_size)
        if n > self.cross_pool.get_num_free_blocks():
            return None
        blocks = self.cross_pool.get_new_blocks(n)
        self.req_to_cross_blocks[request_id] = blocks
        return [b.block_id for b in blocks]

    def get_cross_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_cross_blocks.get(request_id, ())]

    def get_num_free_cross_blocks(self) -> int:
        return self.cross_pool.get_num_free_blocks() if self.cross_pool is not None else 0

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def num_blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # ---- hashing -------------------------------------------------------------

    def _block_hashes(self, request: KVCacheRequest, num_blocks: int) -> list[BlockHash]:
        """The request's hash list, extended (never recomputed) to ``num_blocks`` entries."""
        hashes = self.req_to_block_hashes.get(request.request_id)
        if hashes is None:
            hashes = self.req_to_block_hashes[request.request_id] = []
        n = len(hashes)
        if n < num_blocks:
            bs = self.block_size
            tokens = request.all_token_ids
            extra = request.block_extra_keys
            parent = hashes[-1] if n else None
            for i in range(n, num_blocks):
                parent = hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs], extra)
                hashes.append(parent)
        return hashes

    # ---- scheduling API ------------------------------------------------------

    def get_computed_blocks(self, request: KVCacheRequest) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of full blocks, leaving at least one token to compute.

        Takes no references: pass the result straight to allocate_slots, with no
        other allocation in between (that could evict the blocks found here).
        """
        if not self.enable_caching or request.skip_prefix_cache:
            return [], 0
        num_tokens = request.num_tokens
        # Cap so the last token is always computed (the model must produce logits).
        max_hit_blocks = (num_tokens - 1) // self.block_size if num_tokens > 0 else 0
        hashes = self._block_hashes(request, max_hit_blocks)
        get_cached = self.block_pool.get_cached_block
        computed: list[KVCacheBlock] = []
        for i in range(max_hit_blocks):
            block = get_cached(hashes[i])
            if block is None:
                break
            computed.append(block)
        num_computed_tokens = len(computed) * self.block_size
        self._stats.record(num_tokens, num_computed_tokens)
        return computed, num_computed_tokens

    def allocate_slots(
        self,
        request: KVCacheRequest,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
    ) -> list[int] | None:
        """Make room for the request's next ``num_new_tokens`` tokens.

        Returns the ids of freshly allocated blocks (possibly empty; prefix hits
        are not included, use get_block_ids for the whole table), or None with no
        side effects when the pool is short: the caller preempts or waits.
        """
        request_id = request.request_id
        new_computed_blocks = new_computed_blocks or []
        req_blocks = self.req_to_blocks.get(request_id)
        num_held = len(req_blocks) if req_blocks is not None else 0
        pool = self.block_pool

        if new_computed_blocks:
            if not self.enable_caching:
                raise ValueError("new_computed_blocks given while prefix caching is off")
            hashes = self._block_hashes(request, num_held + len(new_computed_blocks))
            for i, block in enumerate(new_computed_blocks, start=num_held):
                if block.block_hash is None or block.block_hash != hashes[i]:
                    raise RuntimeError(
                        f"stale prefix hit for {request_id}: {block!r} was evicted between "
                        "get_computed_blocks and allocate_slots"
                    )

        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_slots = num_computed + num_new_tokens
        if self.max_model_len is not None and num_slots > self.max_model_len:
            num_slots = self.max_model_len
        num_required = cdiv(num_slots, self.block_size)
        num_new_blocks = num_required - num_held - len(new_computed_blocks)
        if num_new_blocks < 0:
            num_new_blocks = 0

        if new_computed_blocks or num_new_blocks:
            # Touching a free cached block removes it from the free queue, so it
            # no longer counts as free for the fresh allocation.
            num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
            if num_new_blocks > pool.get_num_free_blocks() - num_evictable_hits:
                return None
            if req_blocks is None:
                req_blocks = self.req_to_blocks[request_id] = []
            if new_computed_blocks:
                pool.touch(new_computed_blocks)
                req_blocks.extend(new_computed_blocks)
                # Hits are indexed already: count them as cached.
                if self.num_cached_block.get(request_id, 0) < len(req_blocks):
                    self.num_cached_block[request_id] = len(req_blocks)
            new_blocks = pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
            req_blocks.extend(new_blocks)
        else:
            new_blocks = []
            if req_blocks is None:
                req_blocks = self.req_to_blocks[request_id] = []

        if self.enable_caching:
            num_known = min(num_slots, request.num_tokens)
            num_full = min(num_known // self.block_size, len(req_blocks))
            num_cached = self.num_cached_block.get(request_id, 0)
            if num_full > num_cached:
                hashes = self._block_hashes(request, num_full)
                pool.cache_full_blocks(req_blocks, hashes, num_cached, num_full)
                self.num_cached_block[request_id] = num_full

        return [b.block_id for b in new_blocks]

    def free(self, request: KVCacheRequest) -> None:
        """Release the request's blocks, tail first, and forget it. Idempotent.

        Call it on finish, abort (even for a request that never ran: its hashes
        may be held from a prefix lookup) and preemption, BEFORE resetting
        request.num_computed_tokens: blocks cached by allocate_slots past
        num_computed_tokens (scheduled in this step, never computed because the
        request is preempted before the forward pass) are uncached here.
        """
        request_id = request.request_id
        cross = self.req_to_cross_blocks.pop(request_id, None)
        if cross and self.cross_pool is not None:
            self.cross_pool.free_blocks(reversed(cross))
        blocks = self.req_to_blocks.pop(request_id, None)
        if blocks:
            num_cached = self.num_cached_block.get(request_id, 0)
            num_done = request.num_computed_tokens // self.block_size
            if num_cached > num_done:
                self.block_pool.uncache_blocks(blocks[num_done:num_cached])
            # Reverse: the tail is less likely to be shared, so it is evicted first.
            self.block_pool.free_blocks(reversed(blocks))
        self.req_to_block_hashes.pop(request_id, None)
        self.num_cached_block.pop(request_id, None)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block hash; False (nothing done) while blocks are in use."""
        return self.block_pool.reset_prefix_cache()
