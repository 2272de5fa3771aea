"""Block hashes, the free queue and the block pool."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vllite_core.core.block_pool import BlockPool
from vllite_core.core.kv_cache_utils import (
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    PrefixCacheStats,
    hash_block_tokens,
    hash_request_tokens,
)

# ---- hashes -------------------------------------------------------------------


def test_hash_chains_on_parent() -> None:
    a = hash_block_tokens(None, [1, 2, 3, 4])
    b = hash_block_tokens(None, [5, 6, 7, 8])
    assert a != b
    assert hash_block_tokens(None, [1, 2, 3, 4]) == a
    # Same tokens, different parent: different hash.
    assert hash_block_tokens(a, [9, 9, 9, 9]) != hash_block_tokens(b, [9, 9, 9, 9])
    # No parent differs from any parent.
    assert hash_block_tokens(None, [9, 9, 9, 9]) != hash_block_tokens(a, [9, 9, 9, 9])
    assert isinstance(a, bytes) and len(a) == 32


def test_hash_extra_keys() -> None:
    base = hash_block_tokens(None, [1, 2, 3, 4])
    lora1 = hash_block_tokens(None, [1, 2, 3, 4], ("lora", 1))
    lora2 = hash_block_tokens(None, [1, 2, 3, 4], ("lora", 2))
    assert len({base, lora1, lora2}) == 3
    assert hash_block_tokens(None, [1, 2, 3, 4], ("lora", 1)) == lora1
    # Type-tagged: the int 1 and the string "1" are different keys.
    assert hash_block_tokens(None, [1], (1,)) != hash_block_tokens(None, [1], ("1",))
    assert hash_block_tokens(None, [1], (True,)) != hash_block_tokens(None, [1], (1,))
    with pytest.raises(TypeError):
        hash_block_tokens(None, [1], (object(),))


def test_hash_token_boundaries_unambiguous() -> None:
    # Token lists are length-prefixed and fixed-width: no concatenation clashes.
    assert hash_block_tokens(None, [1, 23]) != hash_block_tokens(None, [12, 3])
    assert hash_block_tokens(None, [0]) != hash_block_tokens(None, [0, 0])


def test_hash_deterministic_across_processes() -> None:
    code = (
        "from vllite_core.core.kv_cache_utils import hash_request_tokens;"
        "print(b''.join(hash_request_tokens(4, list(range(12)), ('lora', 7))).hex())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
        cwd=str(__import__("pathlib").Path(__file__).resolve().parents[2]),
    ).stdout.strip()
    here = b"".join(hash_request_tokens(4, list(range(12)), ("lora", 7))).hex()
    assert out == here


def test_hash_request_tokens_full_blocks_only() -> None:
    hashes = hash_request_tokens(4, list(range(11)))
    assert len(hashes) == 2
    assert hashes[1] == hash_block_tokens(hashes[0], [4, 5, 6, 7])


# ---- free queue ---------------------------------------------------------------


def test_free_queue_order_and_remove() -> None:
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.num_free_blocks == 6
    q.remove(blocks[3])
    q.remove(blocks[0])
    q.remove(blocks[5])
    assert [b.block_id for b in q.get_all_free_blocks()] == [1, 2, 4]
    assert blocks[3].prev_free is None and blocks[3].next_free is None
    q.append(blocks[3])
    q.append_n([blocks[0], blocks[5]])
    assert [b.block_id for b in q.get_all_free_blocks()] == [1, 2, 4, 3, 0, 5]
    assert q.popleft() is blocks[1]
    assert [b.block_id for b in q.popleft_n(3)] == [2, 4, 3]
    assert q.num_free_blocks == 2
    assert [b.block_id for b in q.get_all_free_blocks()] == [0, 5]
    with pytest.raises(ValueError):
        q.append(blocks[0])  # already queued
    with pytest.raises(ValueError):
        q.remove(blocks[1])  # not queued
    with pytest.raises(ValueError):
        q.popleft_n(3)
    q.popleft_n(2)
    with pytest.raises(ValueError):
        q.popleft()
    assert q.get_all_free_blocks() == []


# ---- pool ---------------------------------------------------------------------


def test_pool_reserves_null_block() -> None:
    pool = BlockPool(5, enable_caching=True)
    assert pool.num_usable_blocks == 4
    assert pool.get_num_free_blocks() == 4
    got = pool.get_new_blocks(4)
    assert sorted(b.block_id for b in got) == [1, 2, 3, 4]
    assert all(b.ref_cnt == 1 for b in got)
    assert pool.get_usage() == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks(got)
    assert pool.get_usage() == 0.0
    with pytest.raises(ValueError):
        BlockPool(1, enable_caching=True)


def test_pool_cache_touch_and_evict() -> None:
    pool = BlockPool(5, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    hashes = hash_request_tokens(2, [1, 2, 3, 4])
    pool.cache_full_blocks(blocks, hashes, 0, 2)
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    assert blocks[1].block_hash == hashes[1]
    pool.free_blocks(reversed(blocks))
    # Free but cached: still findable; touching pulls it out of the free queue.
    assert pool.get_num_free_blocks() == 4
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 1 and pool.get_num_free_blocks() == 3
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 2 and pool.get_num_free_blocks() == 3
    # Allocate everything else: the free cached blocks[1] is evicted.
    rest = pool.get_new_blocks(3)
    assert blocks[1] in rest
    assert blocks[1].block_hash is None
    assert pool.get_cached_block(hashes[1]) is None
    assert pool.get_cached_block(hashes[0]) is blocks[0]


def test_pool_keeps_first_mapping_for_duplicate_hash() -> None:
    pool = BlockPool(5, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [7, 7])
    pool.cache_full_blocks([a], [h], 0, 1)
    pool.cache_full_blocks([b], [h], 0, 1)
    assert pool.get_cached_block(h) is a
    assert b.block_hash is None
    assert len(pool.cached_block_hash_to_block) == 1


def test_pool_double_free_raises() -> None:
    pool = BlockPool(3, enable_caching=False)
    (blk,) = pool.get_new_blocks(1)
    pool.free_blocks([blk])
    with pytest.raises(RuntimeError):
        pool.free_blocks([blk])


def test_pool_caching_disabled_indexes_nothing() -> None:
    pool = BlockPool(3, enable_caching=False)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, [hash_block_tokens(None, [1])], 0, 1)
    assert blocks[0].block_hash is None and not pool.cached_block_hash_to_block


def test_pool_reset_prefix_cache() -> None:
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1])
    pool.cache_full_blocks(blocks, [h], 0, 1)
    assert pool.reset_prefix_cache() is False  # in use
    assert pool.get_cached_block(h) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(h) is None and blocks[0].block_hash is None


def test_prefix_cache_stats() -> None:
    s = PrefixCacheStats()
    assert s.hit_rate == 0.0
    s.record(100, 48)
    s.record(100, 0)
    assert (s.requests, s.queries, s.hits) == (2, 200, 48)
    assert s.hit_rate == pytest.approx(0.24)
    s.reset()
    assert (s.requests, s.queries, s.hits) == (0, 0, 0)


# ---- cache groups, the null block, integrity ------------------------------------------


def test_pool_index_is_keyed_by_group() -> None:
    pool = BlockPool(6, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [1, 2])
    pool.cache_full_blocks([a], [h], 0, 1, group=0)
    pool.cache_full_blocks([b], [h], 0, 1, group=1)  # equal tokens in another group: another entry
    assert pool.get_cached_block(h) is a and pool.get_cached_block(h, 0) is a
    assert pool.get_cached_block(h, 1) is b and pool.get_cached_block(h, 2) is None
    assert (a.group, b.group) == (0, 1) and len(pool.cached_block_hash_to_block) == 2
    # Re-offering an indexed block under its own key is a no-op; under another group it is an error.
    pool.cache_full_blocks([a], [h], 0, 1, group=0)
    with pytest.raises(RuntimeError, match="different hash"):
        pool.cache_full_blocks([a], [h], 0, 1, group=1)
    pool.check_integrity({a.block_id: 1, b.block_id: 1})
    # Eviction drops the entry of the block's own group only.
    pool.free_blocks([b])
    rest = pool.get_new_blocks(4)
    assert b in rest and b.block_hash is None
    assert pool.get_cached_block(h, 1) is None and pool.get_cached_block(h, 0) is a
    pool.check_integrity({blk.block_id: 1 for blk in [a, *rest]})


def test_pool_null_block_is_never_counted_or_indexed() -> None:
    pool = BlockPool(4, enable_caching=True)
    null = pool.null_block
    assert null.block_id == 0 and null.is_null
    (blk,) = pool.get_new_blocks(1)
    hashes = hash_request_tokens(1, [5, 6])
    pool.cache_full_blocks([null, blk], hashes, 0, 2, group=1)  # a sliding-window table with a dead slot
    assert null.block_hash is None and blk.block_hash == hashes[1]
    assert pool.get_cached_block(hashes[0], 1) is None and pool.get_cached_block(hashes[1], 1) is blk
    pool.touch([null])
    pool.free_blocks([null])
    assert null.ref_cnt == 0 and pool.get_num_free_blocks() == 2
    pool.check_integrity({blk.block_id: 1})


def test_pool_uncache_drops_only_the_blocks_own_entry() -> None:
    pool = BlockPool(5, enable_caching=True)
    a, dup = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [3])
    pool.cache_full_blocks([a], [h], 0, 1)
    pool.cache_full_blocks([dup], [h], 0, 1)  # stays unindexed
    pool.uncache_blocks([dup])
    assert pool.get_cached_block(h) is a
    pool.uncache_blocks([a])
    assert pool.get_cached_block(h) is None and a.block_hash is None
    pool.check_integrity({a.block_id: 1, dup.block_id: 1})


def test_pool_check_integrity_catches_disagreements() -> None:
    pool = BlockPool(5, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.check_integrity({a.block_id: 1, b.block_id: 1})
    pool.check_integrity()  # without holders: only the pool's own consistency
    with pytest.raises(AssertionError, match="holders count"):
        pool.check_integrity({a.block_id: 1})
    with pytest.raises(AssertionError, match="holders count"):
        pool.check_integrity({a.block_id: 2, b.block_id: 1})
    a.ref_cnt = 0  # a referenced-looking state out of step with the free queue
    with pytest.raises(AssertionError, match="free state"):
        pool.check_integrity()
    a.ref_cnt = 1
    h = hash_block_tokens(None, [1])
    pool.cache_full_blocks([a], [h], 0, 1)
    a.block_hash = hash_block_tokens(None, [2])  # the index entry no longer matches its block
    with pytest.raises(AssertionError, match="index entry"):
        pool.check_integrity()
