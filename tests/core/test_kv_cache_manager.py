"""KVCacheManager: prefix hits, allocation, eviction order, and a stateful fuzz (one full-attention group)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from vllite_core.core.kv_cache_manager import KVCacheManager, PrefixHit
from vllite_core.core.kv_cache_spec import cdiv
from vllite_core.core.kv_cache_utils import hash_block_tokens, hash_request_tokens
from vllite_core.request import Request
from vllite_core.sampling_params import SamplingParams

BS = 16


def make_request(rid: str, tokens: list[int], *, skip_prefix_cache: bool = False, block_extra_keys: tuple = (),
                 cache_salt: str | None = None) -> Request:
    req = Request(rid, list(tokens), SamplingParams(), block_extra_keys=block_extra_keys, cache_salt=cache_salt)
    req.skip_prefix_cache = skip_prefix_cache
    return req


def admit(mgr: KVCacheManager, req: Request, chunk: int | None = None) -> list[list[int]] | None:
    """What the scheduler does for a waiting request: look up, then allocate."""
    hit, n = mgr.get_computed_blocks(req)
    todo = req.num_tokens - n if chunk is None else min(chunk, req.num_tokens - n)
    new = mgr.allocate_slots(req, todo, hit, n)
    if new is not None:
        req.num_computed_tokens = n + todo
    return new


def run_to_end(mgr: KVCacheManager, req: Request) -> None:
    """Admit the whole prompt, then free (as if finished right after prefill)."""
    assert admit(mgr, req) is not None
    mgr.check_integrity([req])
    mgr.free(req)
    mgr.check_integrity([])


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def hit_blocks(mgr: KVCacheManager, req: Request):
    """The prefix hit in the one group, as (blocks, num_tokens)."""
    hit, n = mgr.get_computed_blocks(req)
    assert isinstance(hit, PrefixHit) and len(hit.blocks) == 1
    return hit, hit.blocks[0], n


# ---- prefix hits ----------------------------------------------------------------


def test_prefix_hit_shares_full_blocks() -> None:
    mgr = KVCacheManager(num_blocks=20, block_size=BS)
    run_to_end(mgr, make_request("a", toks(3 * BS + 5)))
    b = make_request("b", toks(3 * BS) + [999] * 20)
    hit, blocks, n = hit_blocks(mgr, b)
    assert len(blocks) == 3 and hit.num_blocks == 3 and n == 48
    new = mgr.allocate_slots(b, b.num_tokens - n, hit, n)
    assert new is not None and len(new) == 1 and len(new[0]) == 2  # 68 tokens -> 5 blocks, 3 reused
    assert b.block_ids()[:3] == [blk.block_id for blk in blocks]
    assert b.block_ids()[3:] == new[0]  # fresh ids only, hits not repeated
    assert mgr.get_block_ids(b) == [b.block_ids()]
    assert all(blk.ref_cnt == 1 for blk in blocks)
    mgr.check_integrity([b])


def test_full_match_capped_to_leave_one_token() -> None:
    mgr = KVCacheManager(num_blocks=20, block_size=BS)
    run_to_end(mgr, make_request("a", toks(3 * BS)))
    # Exactly the same 3 full blocks: only 2 may be hit (the last token is computed).
    _, blocks, n = hit_blocks(mgr, make_request("b", toks(3 * BS)))
    assert len(blocks) == 2 and n == 2 * BS
    # One more token: all three hit.
    _, blocks, n = hit_blocks(mgr, make_request("c", toks(3 * BS + 1)))
    assert len(blocks) == 3 and n == 3 * BS


def test_skip_prefix_cache_reads_nothing_but_writes() -> None:
    mgr = KVCacheManager(num_blocks=20, block_size=BS)
    run_to_end(mgr, make_request("a", toks(2 * BS + 3)))
    p = make_request("p", toks(4 * BS + 3), skip_prefix_cache=True)
    hit, n = mgr.get_computed_blocks(p)
    assert hit.blocks == [[]] and hit.num_blocks == 0 and n == 0
    assert admit(mgr, p) is not None
    assert len(p.block_ids()) == 5
    mgr.free(p)
    # Its blocks 2 and 3 (not duplicates of a's) are now cached for others.
    _, _, n = hit_blocks(mgr, make_request("c", toks(4 * BS + 3)))
    assert n == 4 * BS


def test_skip_prefix_cache_from_prompt_logprobs() -> None:
    req = Request("r", toks(3), SamplingParams(prompt_logprobs=1))
    assert req.skip_prefix_cache
    assert not Request("s", toks(3), SamplingParams()).skip_prefix_cache


def test_caching_disabled() -> None:
    mgr = KVCacheManager(num_blocks=20, block_size=BS, enable_caching=False)
    run_to_end(mgr, make_request("a", toks(3 * BS + 1)))
    b = make_request("b", toks(3 * BS + 1))
    hit, n = mgr.get_computed_blocks(b)
    assert hit.blocks == [[]] and n == 0
    assert not mgr.block_pool.cached_block_hash_to_block
    assert mgr.prefix_cache_stats.requests == 0
    assert b.block_hashes == []  # no hasher attached: nothing is hashed


def test_extra_keys_separate_caches() -> None:
    mgr = KVCacheManager(num_blocks=20, block_size=BS)
    run_to_end(mgr, make_request("a", toks(2 * BS + 1), block_extra_keys=("lora", 1)))
    assert mgr.get_computed_blocks(make_request("b", toks(2 * BS + 1)))[1] == 0
    other = make_request("c", toks(2 * BS + 1), block_extra_keys=("lora", 2))
    assert mgr.get_computed_blocks(other)[1] == 0
    same = make_request("d", toks(2 * BS + 1), block_extra_keys=("lora", 1))
    assert mgr.get_computed_blocks(same)[1] == 2 * BS


def test_hit_rate_counters() -> None:
    mgr = KVCacheManager(num_blocks=20, block_size=BS)
    run_to_end(mgr, make_request("a", toks(64)))  # 64 queried, 0 hit
    run_to_end(mgr, make_request("b", toks(64)))  # 64 queried, 48 hit (capped)
    s = mgr.prefix_cache_stats
    assert (s.requests, s.queries, s.hits) == (2, 128, 48)
    assert s.hit_rate == pytest.approx(48 / 128)
    snap = mgr.make_prefix_cache_stats()
    assert (snap.requests, snap.queries, snap.hits) == (2, 128, 48)
    assert (s.requests, s.queries, s.hits) == (0, 0, 0)
    # Skipped lookups are not counted.
    mgr.get_computed_blocks(make_request("c", toks(64), skip_prefix_cache=True))
    assert mgr.prefix_cache_stats.requests == 0


def test_decode_caches_blocks_as_they_fill() -> None:
    mgr = KVCacheManager(num_blocks=20, block_size=4)
    cache = mgr.block_pool.cached_block_hash_to_block
    r = make_request("r", toks(6))
    assert admit(mgr, r) == [[1, 2]]
    assert len(r.block_hashes) == 1  # the hasher is attached on first sight
    assert len(cache) == 1
    r.append_output_token_ids(100)  # sampled token 6
    assert len(r.block_hashes) == 1
    assert mgr.allocate_slots(r, 1) == [[]]
    r.num_computed_tokens += 1
    r.append_output_token_ids(101)  # token 7: the block [4..8) is full of known tokens, hashed at once
    assert len(r.block_hashes) == 2
    assert len(cache) == 1  # ... but indexed only when its last slot is allocated
    assert mgr.allocate_slots(r, 1) == [[]]
    r.num_computed_tokens += 1
    assert len(cache) == 2
    r.append_output_token_ids(102)
    assert mgr.allocate_slots(r, 1) == [[3]]
    r.num_computed_tokens += 1
    expected = hash_request_tokens(4, r.all_token_ids)
    assert r.block_hashes == expected
    assert mgr.block_pool.get_cached_block(expected[1]).block_id == 2
    assert mgr.block_pool.get_cached_block(expected[1], group=1) is None
    assert r.num_cached_blocks == [2]
    mgr.check_integrity([r])


def test_append_several_tokens_hashes_every_filled_block() -> None:
    mgr = KVCacheManager(num_blocks=20, block_size=4)
    r = make_request("r", toks(3))
    mgr.get_computed_blocks(r)
    assert r.block_hashes == []
    r.append_output_token_ids([7, 8, 9, 10, 11, 12])  # 9 tokens: 2 full blocks at once
    assert r.block_hashes == hash_request_tokens(4, r.all_token_ids)
    assert len(r.block_hashes) == 2
    assert list(r.output_token_ids) == [7, 8, 9, 10, 11, 12]


def test_speculative_tokens_beyond_known_not_cached() -> None:
    mgr = KVCacheManager(num_blocks=20, block_size=4)
    r = make_request("r", toks(6))
    # 6 known tokens plus 3 draft slots: 3 blocks, but only 1 block fully known.
    assert mgr.allocate_slots(r, 9) == [[1, 2, 3]]
    assert len(mgr.block_pool.cached_block_hash_to_block) == 1
    assert r.num_cached_blocks == [1]


def test_max_model_len_caps_slots() -> None:
    mgr = KVCacheManager(num_blocks=20, block_size=4, max_model_len=8)
    r = make_request("r", toks(7))
    assert mgr.allocate_slots(r, 12) == [[1, 2]]
    assert r.block_ids() == [1, 2]


# ---- allocation and sharing ---------------------------------------------------


def test_allocate_returns_none_without_side_effects() -> None:
    mgr = KVCacheManager(num_blocks=6, block_size=4)  # 5 usable
    a = make_request("a", toks(9))
    run_to_end(mgr, a)  # blocks 1..3, 2 cached, all free
    holder = make_request("h", [500 + i for i in range(8)])
    assert admit(mgr, holder) is not None  # takes 2 never-used blocks
    assert mgr.get_num_free_blocks() == 3
    # Needs the 2 cached blocks plus 2 fresh: the hits leave the free queue,
    # so only 1 free block is left for 2 fresh ones -> None.
    b = make_request("b", toks(8) + [77] * 8)
    hit, blocks, n = hit_blocks(mgr, b)
    assert len(blocks) == 2
    before = [(blk.block_id, blk.ref_cnt, blk.block_hash) for blk in mgr.block_pool.blocks]
    free_before = mgr.block_pool.free_block_queue.get_all_free_blocks()
    index_before = dict(mgr.block_pool.cached_block_hash_to_block)
    assert mgr.allocate_slots(b, b.num_tokens - n, hit, n) is None
    assert [(blk.block_id, blk.ref_cnt, blk.block_hash) for blk in mgr.block_pool.blocks] == before
    assert mgr.block_pool.free_block_queue.get_all_free_blocks() == free_before
    assert mgr.block_pool.cached_block_hash_to_block == index_before
    assert mgr.get_block_ids(b) == [[]]
    assert b.block_ids() == [] and b.kv_blocks == [[]] and b.num_cached_blocks == [0]
    mgr.check_integrity([holder, b])
    # A shorter chunk fits: 2 hits + 1 fresh block.
    new = mgr.allocate_slots(b, 4, hit, n)
    assert new is not None and len(new[0]) == 1
    assert b.block_ids() == [blk.block_id for blk in blocks] + new[0]
    mgr.check_integrity([holder, b])


def test_shared_prefix_ref_counts() -> None:
    mgr = KVCacheManager(num_blocks=20, block_size=BS)
    a = make_request("a", toks(2 * BS) + [1] * 5)
    assert admit(mgr, a) is not None
    b = make_request("b", toks(2 * BS) + [2] * 5)
    assert admit(mgr, b) is not None
    shared = a.kv_blocks[0][:2]
    assert b.kv_blocks[0][:2] == shared
    assert [blk.ref_cnt for blk in shared] == [2, 2]
    mgr.check_integrity([a, b])
    free_before = mgr.get_num_free_blocks()
    mgr.free(a)
    assert a.kv_blocks == [] and a.block_ids() == []
    assert [blk.ref_cnt for blk in shared] == [1, 1]
    # Only a's private tail block was released; b keeps the shared ones.
    assert mgr.get_num_free_blocks() == free_before + 1
    assert b.kv_blocks[0][:2] == shared
    mgr.check_integrity([b])
    mgr.free(b)
    assert [blk.ref_cnt for blk in shared] == [0, 0]
    assert mgr.get_num_free_blocks() == mgr.num_usable_blocks
    mgr.free(b)  # idempotent
    mgr.free(make_request("unknown", [1]))
    mgr.check_integrity([])


def test_usage_and_reset_prefix_cache() -> None:
    mgr = KVCacheManager(num_blocks=11, block_size=4)
    a = make_request("a", toks(9))
    admit(mgr, a)
    assert mgr.usage == pytest.approx(0.3)
    assert mgr.reset_prefix_cache() is False
    mgr.free(a)
    assert mgr.usage == 0.0
    assert mgr.reset_prefix_cache() is True
    assert mgr.get_computed_blocks(make_request("b", toks(9)))[1] == 0


def test_preempt_before_compute_uncaches_step_blocks() -> None:
    """Blocks cached at allocation but never computed (preempted in the same step) must not hit."""
    mgr = KVCacheManager(num_blocks=20, block_size=4)
    r = make_request("r", toks(13))
    assert admit(mgr, r, chunk=4) is not None  # block 0 computed and cached
    assert mgr.allocate_slots(r, 8) is not None  # blocks 1, 2 cached for this step
    assert len(mgr.block_pool.cached_block_hash_to_block) == 3
    mgr.free(r)  # preempted before the forward pass: num_computed_tokens is still 4
    r.num_computed_tokens = 0
    assert len(mgr.block_pool.cached_block_hash_to_block) == 1
    mgr.check_integrity([r])
    assert mgr.get_computed_blocks(make_request("s", toks(13)))[1] == 4


def test_stale_hit_is_detected() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=4)  # 3 usable
    run_to_end(mgr, make_request("a", toks(9)))
    b = make_request("b", toks(9))
    hit, n = mgr.get_computed_blocks(b)
    assert n == 8
    admit(mgr, make_request("x", [9] * 12))  # evicts everything
    with pytest.raises(RuntimeError, match="stale"):
        mgr.allocate_slots(b, 1, hit, n)


def test_hits_with_caching_off_are_refused() -> None:
    on = KVCacheManager(num_blocks=8, block_size=4)
    run_to_end(on, make_request("a", toks(9)))
    hit, n = on.get_computed_blocks(make_request("b", toks(9)))
    assert n == 8
    off = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    with pytest.raises(ValueError, match="caching is off"):
        off.allocate_slots(make_request("c", toks(9)), 1, hit, n)


# ---- eviction order -------------------------------------------------------------


def test_eviction_order_lru_tail_first() -> None:
    mgr = KVCacheManager(num_blocks=9, block_size=4)  # 8 usable
    a = make_request("a", toks(12) + [0])  # 4 blocks: 1,2,3,4 (3 full cached)
    b = make_request("b", toks(8, 100) + [0])  # 3 blocks: 5,6,7
    assert admit(mgr, a) == [[1, 2, 3, 4]]
    assert admit(mgr, b) == [[5, 6, 7]]
    mgr.free(a)  # older free
    mgr.free(b)  # newer free
    order = [blk.block_id for blk in mgr.block_pool.free_block_queue.get_all_free_blocks()]
    # Blocks without a hash (the partial tails 4 and 7: nothing can hit them) first, newest free first,
    # then never-used 8, then a's cached blocks tail first, then b's tail first.
    assert order == [7, 4, 8, 3, 2, 1, 6, 5]
    # Allocating 3 fresh blocks takes 7, 4 and 8: no cached block is evicted.
    x = make_request("x", [50] * 12)
    assert mgr.allocate_slots(x, 12) == [[7, 4, 8]]
    # The next one evicts a's third block (a was freed first).
    y = make_request("y", [60] * 4)
    assert mgr.allocate_slots(y, 4) == [[3]]
    _, blocks, n = hit_blocks(mgr, make_request("a2", toks(12) + [0]))
    assert [blk.block_id for blk in blocks] == [1, 2]
    assert n == 8  # blocks 1 and 2 still hit; block 3's hash is gone
    a_hashes = hash_request_tokens(4, toks(12))
    assert mgr.block_pool.get_cached_block(a_hashes[2]) is None
    # b's blocks are all still cached (freed later, evicted later).
    assert mgr.get_computed_blocks(make_request("b2", toks(8, 100) + [0]))[1] == 8


def test_hit_block_freed_again_moves_to_tail() -> None:
    mgr = KVCacheManager(num_blocks=6, block_size=4)
    run_to_end(mgr, make_request("a", toks(9)))  # blocks 1,2,3
    run_to_end(mgr, make_request("b", toks(5)))  # hits block 1, allocates 1 fresh
    order = [blk.block_id for blk in mgr.block_pool.free_block_queue.get_all_free_blocks()]
    # Block 1 was reused by b and freed after a's, so it is now at the tail.
    assert order[-1] == 1


# ---- stateful fuzz ----------------------------------------------------------------

FUZZ_BS = 4
FUZZ_BLOCKS = 9  # 8 usable: small enough to force eviction and preemption
FUZZ_MAX_LEN = 28


def expected_hashes(req: Request) -> list[bytes]:
    """The hash chain of a request's full blocks, built independently of the manager's hasher: the salt
    is an extra key of the first block only, the per-request keys of every block."""
    out: list[bytes] = []
    parent = None
    tokens = list(req.all_token_ids)
    for i in range(len(tokens) // FUZZ_BS):
        keys = tuple(req.block_extra_keys)
        if i == 0 and req.cache_salt is not None:
            keys = (("cache_salt", req.cache_salt),) + keys
        parent = hash_block_tokens(parent, tokens[i * FUZZ_BS:(i + 1) * FUZZ_BS], keys)
        out.append(parent)
    return out


class KVCacheMachine(RuleBasedStateMachine):
    """A toy scheduler driving the manager; a shadow KV store checks every hit's content."""

    def __init__(self) -> None:
        super().__init__()
        self.mgr = KVCacheManager(FUZZ_BLOCKS, FUZZ_BS, max_model_len=FUZZ_MAX_LEN)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        # Token sequences to draw shared prefixes from, with the salt and extra keys they were cached under.
        self.seen: list[tuple[list[int], str | None, tuple]] = [([], None, ())]
        self.next_id = 0
        # block_id -> token written at each slot (None: not written since allocation).
        self.kv: dict[int, list[int | None]] = {}
        # block_id -> (salt, extra keys) of the request that wrote it: a hit must come from the same cache.
        self.kv_keys: dict[int, tuple] = {}

    # -- helpers --

    def _new_request(self, prompt: list[int], skip: bool, lora: tuple, salt: str | None = None) -> None:
        self.waiting.append(make_request(f"r{self.next_id}", prompt, skip_prefix_cache=skip,
                                         block_extra_keys=lora, cache_salt=salt))
        self.next_id += 1

    def _write(self, req: Request, start: int, end: int) -> None:
        """Record that tokens [start, end) of req were computed into its blocks."""
        blocks = req.kv_blocks[0]
        for pos in range(start, min(end, req.num_tokens)):
            bid = blocks[pos // FUZZ_BS].block_id
            self.kv[bid][pos % FUZZ_BS] = req.all_token_ids[pos]
            self.kv_keys[bid] = (req.cache_salt, req.block_extra_keys)

    def _fresh(self, ids: list[list[int]]) -> None:
        assert len(ids) == 1
        for bid in ids[0]:
            assert bid != 0, "null block handed out"
            if bid in self.kv and None not in self.kv[bid]:
                event("reused a block that held a full block of KV")
            self.kv[bid] = [None] * FUZZ_BS
            self.kv_keys.pop(bid, None)

    def _after_compute(self, req: Request, token: int) -> None:
        if req.num_computed_tokens == req.num_tokens:
            req.append_output_token_ids(token)  # prompt or decode done: sample one token
        if req.num_tokens >= FUZZ_MAX_LEN:
            self._release(req)

    def _release(self, req: Request) -> None:
        self.mgr.free(req)
        (self.waiting if req in self.waiting else self.running).remove(req)
        self.seen.append((list(req.all_token_ids), req.cache_salt, req.block_extra_keys))
        assert req.kv_blocks == [] and req.num_cached_blocks == []
        assert req.block_ids() == []

    def _snapshot(self, req: Request) -> tuple:
        pool = self.mgr.block_pool
        return (
            [(b.ref_cnt, b.block_hash, b.group) for b in pool.blocks],
            [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
            dict(pool.cached_block_hash_to_block),
            self.mgr.get_block_ids(req),
            list(req.num_cached_blocks),
        )

    def _advance(self, req: Request, chunk: int, token: int) -> None:
        """One scheduled chunk for a running request; preempt it if blocks run out."""
        num_new = min(chunk, req.num_tokens - req.num_computed_tokens)
        assert num_new > 0
        before = self._snapshot(req)
        new = self.mgr.allocate_slots(req, num_new)
        if new is None:
            assert self._snapshot(req) == before
            event("preempted")
            self.mgr.free(req)  # recompute preemption: release all, back to waiting
            req.num_computed_tokens = 0
            self.running.remove(req)
            self.waiting.append(req)
            return
        self._fresh(new)
        assert req.block_ids()[-len(new[0]):] == new[0] or not new[0]
        start = req.num_computed_tokens
        req.num_computed_tokens += num_new
        self._write(req, start, req.num_computed_tokens)
        self._after_compute(req, token)

    # -- rules --

    @rule(
        src=st.integers(0, 1000),
        prefix_blocks=st.sampled_from([0, 1, 2, 3, 9, 9]),
        suffix=st.lists(st.integers(0, 2), min_size=0, max_size=10),
        skip=st.sampled_from([False, False, False, True]),
        lora=st.sampled_from([(), (), (), ("lora", 1)]),
        salt=st.sampled_from([None, None, None, "s1", "s2"]),
        same_keys=st.booleans(),
    )
    def add(self, src: int, prefix_blocks: int, suffix: list[int], skip: bool, lora: tuple,
            salt: str | None, same_keys: bool) -> None:
        base, base_salt, base_lora = self.seen[src % len(self.seen)]
        if same_keys:  # the base's cache: hits expected; otherwise maybe another salt or LoRA: no hits
            salt, lora = base_salt, base_lora
        prompt = (base[: prefix_blocks * FUZZ_BS] + suffix)[: FUZZ_MAX_LEN - 6] or [0]
        self._new_request(prompt, skip, lora, salt)

    @rule(src=st.integers(0, 1000))
    def resubmit_whole_blocks(self, src: int) -> None:
        """Re-send a finished sequence cut to whole blocks: a full prefix match."""
        base, salt, lora = self.seen[src % len(self.seen)]
        n = min(len(base), FUZZ_MAX_LEN - 8) // FUZZ_BS * FUZZ_BS
        if n:
            self._new_request(list(base[:n]), False, lora, salt)

    def _admit(self, req: Request, chunk: int, token: int) -> bool:
        """Prefix lookup then allocation for a waiting request; False if it does not fit."""
        hit, n = self.mgr.get_computed_blocks(req)
        assert len(hit.blocks) == 1
        blocks = hit.blocks[0]
        assert n % FUZZ_BS == 0 and n < req.num_tokens and n == len(blocks) * FUZZ_BS
        # Every hit's KV must hold exactly this request's tokens, written under the same salt and keys.
        for i, blk in enumerate(blocks):
            assert self.kv[blk.block_id] == req.all_token_ids[i * FUZZ_BS : (i + 1) * FUZZ_BS]
            assert self.kv_keys[blk.block_id] == (req.cache_salt, req.block_extra_keys)
        if req.skip_prefix_cache:
            assert n == 0
        if n:
            event("prefix hit")
            if req.cache_salt is not None:
                event("prefix hit under a salt")
            if req.block_extra_keys:
                event("prefix hit under extra keys")
        num_new = min(chunk, req.num_tokens - n)
        before = self._snapshot(req)
        new = self.mgr.allocate_slots(req, num_new, hit, n)
        if new is None:
            assert self._snapshot(req) == before
            assert self.mgr.get_block_ids(req) == [[]]
            event("waiting request did not fit")
            return False
        self._fresh(new)
        assert req.block_ids() == [b.block_id for b in blocks] + new[0]
        self.waiting.remove(req)
        self.running.append(req)
        req.num_computed_tokens = n + num_new
        self._write(req, n, n + num_new)
        self._after_compute(req, token)
        return True

    @initialize(prompt=st.lists(st.integers(0, 2), min_size=9, max_size=14), n=st.integers(1, 3))
    def seed_requests(self, prompt: list[int], n: int) -> None:
        """Start with a family of requests sharing a prompt, so hits happen early."""
        for i in range(n):
            self._new_request(prompt + [i], False, ())

    @rule(idx=st.integers(0, 1000), chunk=st.integers(1, 20), token=st.integers(0, 2))
    def schedule_waiting(self, idx: int, chunk: int, token: int) -> None:
        if self.waiting:
            self._admit(self.waiting[idx % len(self.waiting)], chunk, token)

    @rule(chunk=st.integers(1, 8), token=st.integers(0, 2))
    def tick(self, chunk: int, token: int) -> None:
        """A scheduler step: advance every running request, then admit in FCFS order."""
        for req in list(self.running):
            if req in self.running:
                self._advance(req, chunk, token)
        for req in list(self.waiting):
            if not self._admit(req, chunk, token):
                break

    @rule(idx=st.integers(0, 1000), chunk=st.integers(1, 20), token=st.integers(0, 2))
    def step_one(self, idx: int, chunk: int, token: int) -> None:
        if self.running:
            self._advance(self.running[idx % len(self.running)], chunk, token)

    @rule(idx=st.integers(0, 1000), chunk=st.integers(1, 20))
    def preempt_after_schedule(self, idx: int, chunk: int) -> None:
        """Schedule a chunk, then preempt the request before its KV is computed."""
        if not self.running:
            return
        req = self.running[idx % len(self.running)]
        new = self.mgr.allocate_slots(req, min(chunk, req.num_tokens - req.num_computed_tokens))
        if new is not None:
            self._fresh(new)  # allocated, never written
        self.mgr.free(req)
        req.num_computed_tokens = 0
        self.running.remove(req)
        self.waiting.append(req)

    @rule(idx=st.integers(0, 1000))
    def finish(self, idx: int) -> None:
        if self.running:
            self._release(self.running[idx % len(self.running)])

    @rule(idx=st.integers(0, 1000))
    def abort(self, idx: int) -> None:
        reqs = self.waiting + self.running
        if reqs:
            self._release(reqs[idx % len(reqs)])

    # -- invariants --

    @invariant()
    def manager_integrity(self) -> None:
        self.mgr.check_integrity(self.running + self.waiting)

    @invariant()
    def pool_consistent(self) -> None:
        mgr = self.mgr
        pool = mgr.block_pool
        free = pool.free_block_queue.get_all_free_blocks()
        free_ids = {b.block_id for b in free}
        assert len(free_ids) == len(free) == pool.get_num_free_blocks()
        assert 0 not in free_ids and pool.null_block.ref_cnt == 0
        refs: dict[int, int] = {}
        for req in self.running:
            assert len(req.kv_blocks) == 1
            blocks = req.kv_blocks[0]
            assert len(blocks) == cdiv(req.num_computed_tokens, FUZZ_BS)
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for req in self.waiting:
            assert not any(req.kv_blocks)
        assert 0 not in refs
        assert not (free_ids & refs.keys()), "a referenced block is in the free queue"
        assert len(free_ids) + len(refs) == pool.num_usable_blocks
        for b in pool.blocks:
            assert b.ref_cnt >= 0
            assert b.ref_cnt == refs.get(b.block_id, 0)
            if b.block_hash is not None:
                assert b.group == 0
                assert pool.cached_block_hash_to_block[(b.block_hash, b.group)] is b
        for (h, g), b in pool.cached_block_hash_to_block.items():
            assert b.block_hash == h and g == 0
            assert None not in self.kv[b.block_id]  # cached blocks hold a full block of KV

    @invariant()
    def hashes_match_tokens(self) -> None:
        for req in self.running + self.waiting:
            if req.block_hasher is None:
                continue  # never seen by the manager yet
            # Hashes follow the tokens as they are appended: every full block is hashed.
            expected = expected_hashes(req)
            assert req.block_hashes == expected
        for req in self.running:
            # Every full block of computed, known tokens has been offered to the cache,
            # and a block indexed in the pool is indexed under this request's hash.
            num_full = min(req.num_computed_tokens, req.num_tokens) // FUZZ_BS
            assert req.num_cached_blocks == [num_full]
            for i, blk in enumerate(req.kv_blocks[0][:num_full]):
                assert blk.block_hash in (None, req.block_hashes[i])


KVCacheMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_kv_cache_state_machine = KVCacheMachine.TestCase
