"""The pool of physical KV blocks: allocation, reference counts, prefix-cache index.

One pool serves every cache group of a model (full attention, sliding window, cross
attention...): a block belongs to one group at a time, and the prefix-cache index is
keyed by (block hash, group) so equal tokens in two groups are two entries."""

from __future__ import annotations

from typing import Iterable, Sequence

from vllite_core.core.kv_cache_utils import BlockHash, FreeKVCacheBlockQueue, KVCacheBlock


class BlockPool:
    """Owns every KV block and decides which one to evict next.

    A block is in exactly one of two states: referenced (ref_cnt > 0, held by
    running requests) or free (ref_cnt == 0, in the free queue). A free block
    keeps its hash and stays findable by prefix lookups until it is evicted,
    i.e. popped from the front of the free queue for a new allocation.

    Block 0 is the null block: reserved so block tables can be zero-padded;
    it is never handed out.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        # One block per (group, hash): a second block with the same content stays unindexed.
        self.cached_block_hash_to_block: dict[tuple[int, BlockHash], KVCacheBlock] = {}

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks held by requests (free-but-cached counts as free)."""
        return 1.0 - self.free_block_queue.num_free_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash, group: int = 0) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get((block_hash, group))

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks from the front of the free queue, evicting their cache entries."""
        if n > self.free_block_queue.num_free_blocks:
            raise ValueError(
                f"cannot allocate {n} blocks: only {self.free_block_queue.num_free_blocks} free"
            )
        blocks = self.free_block_queue.popleft_n(n)
        cache = self.cached_block_hash_to_block
        for block in blocks:
            if block.block_hash is not None:
                del cache[(block.block_hash, block.group)]
                block.block_hash = None
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on each block (prefix hits); a free one leaves the free queue.
        The null block is never counted (it stands for blocks a request does not hold)."""
        queue = self.free_block_queue
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                queue.remove(block)
            block.ref_cnt += 1

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        group: int = 0,
    ) -> None:
        """Index ``blocks[num_cached_blocks:num_full_blocks]`` under their hashes.

        ``block_hashes[i]`` is the hash of ``blocks[i]``. A block already indexed
        (a prefix hit) is skipped, and so is the null block (a sliding-window slot
        that fell out of the window); if another block already holds the hash in
        ``group``, the existing mapping wins and this block stays unindexed (it is a
        duplicate that will simply be reused on eviction).
        """
        if not self.enable_caching:
            return
        cache = self.cached_block_hash_to_block
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null:
                continue
            block_hash = block_hashes[i]
            if block.block_hash is not None:
                if block.block_hash != block_hash or block.group != group:
                    raise RuntimeError(f"{block!r} is already cached under a different hash")
                continue
            key = (block_hash, group)
            if key in cache:
                continue
            block.block_hash = block_hash
            block.group = group
            cache[key] = block

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop the cache entries of blocks whose KV will never be written.

        Blocks are cached when allocated (before the forward pass); a request
        preempted in the same step never computes them, so they must not hit.
        """
        cache = self.cached_block_hash_to_block
        for block in blocks:
            key = (block.block_hash, block.group)
            if block.block_hash is not None and cache.get(key) is block:
                del cache[key]
                block.block_hash = None

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; those reaching 0 go to the queue tail, or to its front
        when they hold no cached hash (nothing a later request could hit: reusing them first keeps the
        cached blocks longer, and keeps the cache memory in use small where untouched memory is
        cheap until first written, as the CPU platform's is).

        Pass blocks in the order they should be evicted (a request's blocks in
        reverse, so its tail goes before its shared head).
        """
        queue = self.free_block_queue
        for block in ordered_blocks:
            if block.is_null:
                continue
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block!r}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    queue.appendleft(block)
                else:
                    queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        if self.free_block_queue.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True

    def check_integrity(self, expected_refs: dict[int, int] | None = None) -> None:
        """Raise AssertionError unless the pool is consistent: every usable block is either free (ref 0, in
        the queue) or referenced (not in it); every index entry points at a block that carries that key; the
        null block is never handed out. ``expected_refs`` (block id -> references the holders count) is
        checked too. Cheap enough to call when the engine is idle, and after every step in tests."""
        free = self.free_block_queue.get_all_free_blocks()
        assert len(free) == self.free_block_queue.num_free_blocks, "free count out of step with the queue"
        free_ids = {b.block_id for b in free}
        assert len(free_ids) == len(free), "a block is twice in the free queue"
        assert 0 not in free_ids and self.null_block.ref_cnt == 0, "the null block was handed out"
        for block in self.blocks[1:]:
            in_queue = block.block_id in free_ids
            assert block.ref_cnt >= 0, f"{block!r}: negative references"
            assert in_queue == (block.ref_cnt == 0), f"{block!r}: free state and reference count disagree"
            if expected_refs is not None:
                want = expected_refs.get(block.block_id, 0)
                assert block.ref_cnt == want, f"{block!r}: {block.ref_cnt} references, holders count {want}"
        referenced = sum(1 for b in self.blocks[1:] if b.ref_cnt > 0)
        assert referenced + len(free) == self.num_usable_blocks, "free + referenced != usable"
        for (block_hash, group), block in self.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash and block.group == group, f"index entry points at {block!r}"
        indexed = sum(1 for b in self.blocks if b.block_hash is not None)
        assert indexed == len(self.cached_block_hash_to_block), "a block carries a hash the index lost"
