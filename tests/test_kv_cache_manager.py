"""KVCacheManager: prefix hits, allocation, eviction order, and a stateful fuzz."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from vllite_core.core.kv_cache_manager import KVCacheManager
from vllite_core.core.kv_cache_utils import hash_request_tokens

BS = 16


@dataclass
class FakeRequest:
    """The slice of the engine's Request that the manager reads."""

    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int = -1
    num_computed_tokens: int = 0
    block_extra_keys: tuple = ()
    skip_prefix_cache: bool = False
    output_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.all_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append(self, token: int) -> None:
        self.all_token_ids.append(token)
        self.output_token_ids.append(token)


def admit(mgr: KVCacheManager, req: FakeRequest, chunk: int | None = None) -> list[int] | None:
    """What the scheduler does for a waiting request: look up, then allocate."""
    blocks, n = mgr.get_computed_blocks(req)
    todo = req.num_tokens - n if chunk is None else min(chunk, req.num_tokens - n)
    new = mgr.allocate_slots(req, todo, blocks, n)
    if new is not None:
        req.num_computed_tokens = n + todo
    return new


def run_to_end(mgr: KVCacheManager, req: FakeRequest) -> None:
    """Admit the whole prompt, then free (as if finished right after prefill)."""
    assert admit(mgr, req) is not None
    mgr.free(req)


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


# ---- prefix hits ----------------------------------------------------------------


def test_prefix_hit_shares_full_blocks() -> None:
    mgr = KVCacheManager(num_blocks=20, block_size=BS)
    a = FakeRequest("a", toks(3 * BS + 5))
    run_to_end(mgr, a)
    b = FakeRequest("b", toks(3 * BS) + [999] * 20)
    blocks, n = mgr.get_computed_blocks(b)
    assert len(blocks) == 3 and n == 48
    new = mgr.allocate_slots(b, b.num_tokens - n, blocks, n)
    assert new is not None and len(new) == 2  # 68 tokens -> 5 blocks, 3 reused
    assert mgr.get_block_ids("b")[:3] == [blk.block_id for blk in blocks]
    assert all(blk.ref_cnt == 1 for blk in blocks)


def test_full_match_capped_to_leave_one_token() -> None:
    mgr = KVCacheManager(num_blocks=20, block_size=BS)
    run_to_end(mgr, FakeRequest("a", toks(3 * BS)))
    # Exactly the same 3 full blocks: only 2 may be hit (the last token is computed).
    blocks, n = mgr.get_computed_blocks(FakeRequest("b", toks(3 * BS)))
    assert len(blocks) == 2 and n == 2 * BS
    # One more token: all three hit.
    blocks, n = mgr.get_computed_blocks(FakeRequest("c", toks(3 * BS + 1)))
    assert len(blocks) == 3 and n == 3 * BS


def test_skip_prefix_cache_reads_nothing_but_writes() -> None:
    mgr = KVCacheManager(num_blocks=20, block_size=BS)
    run_to_end(mgr, FakeRequest("a", toks(2 * BS + 3)))
    p = FakeRequest("p", toks(4 * BS + 3), skip_prefix_cache=True)
    assert mgr.get_computed_blocks(p) == ([], 0)
    assert admit(mgr, p) is not None
    assert len(mgr.get_block_ids("p")) == 5
    mgr.free(p)
    # Its blocks 2 and 3 (not duplicates of a's) are now cached for others.
    blocks, n = mgr.get_computed_blocks(FakeRequest("c", toks(4 * BS + 3)))
    assert n == 4 * BS


def test_caching_disabled() -> None:
    mgr = KVCacheManager(num_blocks=20, block_size=BS, enable_caching=False)
    run_to_end(mgr, FakeRequest("a", toks(3 * BS + 1)))
    assert mgr.get_computed_blocks(FakeRequest("b", toks(3 * BS + 1))) == ([], 0)
    assert not mgr.block_pool.cached_block_hash_to_block
    assert mgr.prefix_cache_stats.requests == 0


def test_extra_keys_separate_caches() -> None:
    mgr = KVCacheManager(num_blocks=20, block_size=BS)
    run_to_end(mgr, FakeRequest("a", toks(2 * BS + 1), block_extra_keys=("lora", 1)))
    assert mgr.get_computed_blocks(FakeRequest("b", toks(2 * BS + 1)))[1] == 0
    other = FakeRequest("c", toks(2 * BS + 1), block_extra_keys=("lora", 2))
    assert mgr.get_computed_blocks(other)[1] == 0
    same = FakeRequest("d", toks(2 * BS + 1), block_extra_keys=("lora", 1))
    assert mgr.get_computed_blocks(same)[1] == 2 * BS


def test_hit_rate_counters() -> None:
    mgr = KVCacheManager(num_blocks=20, block_size=BS)
    run_to_end(mgr, FakeRequest("a", toks(64)))  # 64 queried, 0 hit
    run_to_end(mgr, FakeRequest("b", toks(64)))  # 64 queried, 48 hit (capped)
    s = mgr.prefix_cache_stats
    assert (s.requests, s.queries, s.hits) == (2, 128, 48)
    assert s.hit_rate == pytest.approx(48 / 128)
    snap = mgr.make_prefix_cache_stats()
    assert (snap.requests, snap.queries, snap.hits) == (2, 128, 48)
    assert (s.requests, s.queries, s.hits) == (0, 0, 0)
    # Skipped lookups are not counted.
    mgr.get_computed_blocks(FakeRequest("c", toks(64), skip_prefix_cache=True))
    assert mgr.prefix_cache_stats.requests == 0


def test_decode_caches_blocks_as_they_fill() -> None:
    mgr = KVCacheManager(num_blocks=20, block_size=4)
    r = FakeRequest("r", toks(6))
    assert admit(mgr, r) == [1, 2]
    assert len(mgr.block_pool.cached_block_hash_to_block) == 1
    r.append(100)  # sampled token 6
    assert mgr.allocate_slots(r, 1) == []
    r.num_computed_tokens += 1
    r.append(101)  # token 7: the block [4..8) fills when it is computed
    assert len(mgr.block_pool.cached_block_hash_to_block) == 1
    assert mgr.allocate_slots(r, 1) == []
    r.num_computed_tokens += 1
    assert len(mgr.block_pool.cached_block_hash_to_block) == 2
    r.append(102)
    assert mgr.allocate_slots(r, 1) == [3]
    expected = hash_request_tokens(4, r.all_token_ids)
    assert mgr.req_to_block_hashes["r"] == expected
    assert mgr.block_pool.get_cached_block(expected[1]).block_id == 2


def test_speculative_tokens_beyond_known_not_cached() -> None:
    mgr = KVCacheManager(num_blocks=20, block_size=4)
    r = FakeRequest("r", toks(6))
    # 6 known tokens plus 3 draft slots: 3 blocks, but only 1 block fully known.
    assert mgr.allocate_slots(r, 9) == [1, 2, 3]
    assert len(mgr.block_pool.cached_block_hash_to_block) == 1


def test_max_model_len_caps_slots() -> None:
    mgr = KVCacheManager(num_blocks=20, block_size=4, max_model_len=8)
    r = FakeRequest("r", toks(7))
    assert mgr.allocate_slots(r, 12) == [1, 2]


# ---- allocation and sharing ---------------------------------------------------


def test_allocate_returns_none_without_side_effects() -> None:
    mgr = KVCacheManager(num_blocks=6, block_size=4)  # 5 usable
    a = FakeRequest("a", toks(9))
    run_to_end(mgr, a)  # blocks 1..3, 2 cached, all free
    holder = FakeRequest("h", [500 + i for i in range(8)])
    assert admit(mgr, holder) is not None  # takes 2 never-used blocks
    assert mgr.get_num_free_blocks() == 3
    # Needs the 2 cached blocks plus 2 fresh: the hits leave the free queue,
    # so only 1 free block is left for 2 fresh ones -> None.
    b = FakeRequest("b", toks(8) + [77] * 8)
    blocks, n = mgr.get_computed_blocks(b)
    assert len(blocks) == 2
    before = [(blk.block_id, blk.ref_cnt, blk.block_hash) for blk in mgr.block_pool.blocks]
    free_before = mgr.block_pool.free_block_queue.get_all_free_blocks()
    assert mgr.allocate_slots(b, b.num_tokens - n, blocks, n) is None
    assert [(blk.block_id, blk.ref_cnt, blk.block_hash) for blk in mgr.block_pool.blocks] == before
    assert mgr.block_pool.free_block_queue.get_all_free_blocks() == free_before
    assert mgr.get_block_ids("b") == []
    assert "b" not in mgr.req_to_blocks
    # A shorter chunk fits: 2 hits + 1 fresh block.
    new = mgr.allocate_slots(b, 4, blocks, n)
    assert new is not None and len(new) == 1


def test_shared_prefix_ref_counts() -> None:
    mgr = KVCacheManager(num_blocks=20, block_size=BS)
    a = FakeRequest("a", toks(2 * BS) + [1] * 5)
    assert admit(mgr, a) is not None
    b = FakeRequest("b", toks(2 * BS) + [2] * 5)
    assert admit(mgr, b) is not None
    shared = mgr.req_to_blocks["a"][:2]
    assert mgr.req_to_blocks["b"][:2] == shared
    assert [blk.ref_cnt for blk in shared] == [2, 2]
    free_before = mgr.get_num_free_blocks()
    mgr.free(a)
    assert [blk.ref_cnt for blk in shared] == [1, 1]
    # Only a's private tail block was released; b keeps the shared ones.
    assert mgr.get_num_free_blocks() == free_before + 1
    assert mgr.req_to_blocks["b"][:2] == shared
    mgr.free(b)
    assert [blk.ref_cnt for blk in shared] == [0, 0]
    assert mgr.get_num_free_blocks() == mgr.num_usable_blocks
    mgr.free(b)  # idempotent
    mgr.free(FakeRequest("unknown", [1]))


def test_usage_and_reset_prefix_cache() -> None:
    mgr = KVCacheManager(num_blocks=11, block_size=4)
    a = FakeRequest("a", toks(9))
    admit(mgr, a)
    assert mgr.usage == pytest.approx(0.3)
    assert mgr.reset_prefix_cache() is False
    mgr.free(a)
    assert mgr.usage == 0.0
    assert mgr.reset_prefix_cache() is True
    assert mgr.get_computed_blocks(FakeRequest("b", toks(9)))[1] == 0


def test_preempt_before_compute_uncaches_step_blocks() -> None:
    """Blocks cached at allocation but never computed (preempted in the same step) must not hit."""
    mgr = KVCacheManager(num_blocks=20, block_size=4)
    r = FakeRequest("r", toks(13))
    assert admit(mgr, r, chunk=4) is not None  # block 0 computed and cached
    assert mgr.allocate_slots(r, 8) is not None  # blocks 1, 2 cached for this step
    assert len(mgr.block_pool.cached_block_hash_to_block) == 3
    mgr.free(r)  # preempted before the forward pass: num_computed_tokens is still 4
    r.num_computed_tokens = 0
    assert len(mgr.block_pool.cached_block_hash_to_block) == 1
    assert mgr.get_computed_blocks(FakeRequest("s", toks(13)))[1] == 4


def test_stale_hit_is_detected() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=4)  # 3 usable
    run_to_end(mgr, FakeRequest("a", toks(9)))
    b = FakeRequest("b", toks(9))
    blocks, n = mgr.get_computed_blocks(b)
    assert n == 8
    admit(mgr, FakeRequest("x", [9] * 12))  # evicts everything
    with pytest.raises(RuntimeError, match="stale"):
        mgr.allocate_slots(b, 1, blocks, n)


# ---- eviction order -------------------------------------------------------------


def test_eviction_order_lru_tail_first() -> None:
    mgr = KVCacheManager(num_blocks=9, block_size=4)  # 8 usable
    a = FakeRequest("a", toks(12) + [0])  # 4 blocks: 1,2,3,4 (3 full cached)
    b = FakeRequest("b", toks(8, 100) + [0])  # 3 blocks: 5,6,7
    assert admit(mgr, a) == [1, 2, 3, 4]
    assert admit(mgr, b) == [5, 6, 7]
    mgr.free(a)  # older free
    mgr.free(b)  # newer free
    order = [blk.block_id for blk in mgr.block_pool.free_block_queue.get_all_free_blocks()]
    # Never-used first, then a's blocks tail first, then b's tail first.
    assert order == [8, 4, 3, 2, 1, 7, 6, 5]
    # Allocating 3 fresh blocks takes 8, 4 and 3: a's third block is evicted.
    x = FakeRequest("x", [50] * 12)
    assert mgr.allocate_slots(x, 12) == [8, 4, 3]
    blocks, n = mgr.get_computed_blocks(FakeRequest("a2", toks(12) + [0]))
    assert [blk.block_id for blk in blocks] == [1, 2]
    assert n == 8  # blocks 1 and 2 still hit; block 3's hash is gone
    a_hashes = hash_request_tokens(4, toks(12))
    assert mgr.block_pool.get_cached_block(a_hashes[2]) is None
    # b's blocks are all still cached (freed later, evicted later).
    assert mgr.get_computed_blocks(FakeRequest("b2", toks(8, 100) + [0]))[1] == 8


def test_hit_block_freed_again_moves_to_tail() -> None:
    mgr = KVCacheManager(num_blocks=6, block_size=4)
    run_to_end(mgr, FakeRequest("a", toks(9)))  # blocks 1,2,3
    run_to_end(mgr, FakeRequest("b", toks(5)))  # hits block 1, allocates 1 fresh
    order = [blk.block_id for blk in mgr.block_pool.free_block_queue.get_all_free_blocks()]
    # Block 1 was reused by b and freed after a's, so it is now at the tail.
    assert order[-1] == 1


# ---- stateful fuzz ----------------------------------------------------------------

FUZZ_BS = 4
FUZZ_BLOCKS = 9  # 8 usable: small enough to force eviction and preemption
FUZZ_MAX_LEN = 28


class KVCacheMachine(RuleBasedStateMachine):
    """A toy scheduler driving the manager; a shadow KV store checks every hit's content."""

    def __init__(self) -> None:
        super().__init__()
        self.mgr = KVCacheManager(FUZZ_BLOCKS, FUZZ_BS, max_model_len=FUZZ_MAX_LEN)
        self.waiting: list[FakeRequest] = []
        self.running: list[FakeRequest] = []
        self.seen: list[list[int]] = [[]]  # token sequences to draw shared prefixes from
        self.next_id = 0
        # block_id -> token written at each slot (None: not written since allocation).
        self.kv: dict[int, list[int | None]] = {}

    # -- helpers --

    def _new_request(self, prompt: list[int], skip: bool, lora: tuple) -> None:
        self.waiting.append(
            FakeRequest(f"r{self.next_id}", prompt, skip_prefix_cache=skip, block_extra_keys=lora)
        )
        self.next_id += 1

    def _write(self, req: FakeRequest, start: int, end: int) -> None:
        """Record that tokens [start, end) of req were computed into its blocks."""
        blocks = self.mgr.req_to_blocks[req.request_id]
        for pos in range(start, min(end, req.num_tokens)):
            self.kv[blocks[pos // FUZZ_BS].block_id][pos % FUZZ_BS] = req.all_token_ids[pos]

    def _fresh(self, ids: list[int]) -> None:
        for bid in ids:
            assert bid != 0, "null block handed out"
            if bid in self.kv and None not in self.kv[bid]:
                event("reused a block that held a full block of KV")
            self.kv[bid] = [None] * FUZZ_BS

    def _after_compute(self, req: FakeRequest, token: int) -> None:
        if req.num_computed_tokens == req.num_tokens:
            req.append(token)  # prompt or decode done: sample one token
        if req.num_tokens >= FUZZ_MAX_LEN:
            self._release(req)

    def _release(self, req: FakeRequest) -> None:
        self.mgr.free(req)
        (self.waiting if req in self.waiting else self.running).remove(req)
        self.seen.append(list(req.all_token_ids))
        assert req.request_id not in self.mgr.req_to_blocks
        assert req.request_id not in self.mgr.req_to_block_hashes

    def _snapshot(self) -> tuple:
        pool = self.mgr.block_pool
        return (
            [(b.ref_cnt, b.block_hash) for b in pool.blocks],
            [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
            dict(pool.cached_block_hash_to_block),
        )

    def _advance(self, req: FakeRequest, chunk: int, token: int) -> None:
        """One scheduled chunk for a running request; preempt it if blocks run out."""
        num_new = min(chunk, req.num_tokens - req.num_computed_tokens)
        assert num_new > 0
        before = self._snapshot()
        new = self.mgr.allocate_slots(req, num_new)
        if new is None:
            assert self._snapshot() == before
            event("preempted")
            self.mgr.free(req)  # recompute preemption: release all, back to waiting
            req.num_computed_tokens = 0
            self.running.remove(req)
            self.waiting.append(req)
            return
        self._fresh(new)
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
    )
    def add(self, src: int, prefix_blocks: int, suffix: list[int], skip: bool, lora: tuple) -> None:
        base = self.seen[src % len(self.seen)]
        prompt = (base[: prefix_blocks * FUZZ_BS] + suffix)[: FUZZ_MAX_LEN - 6] or [0]
        self._new_request(prompt, skip, lora)

    @rule(src=st.integers(0, 1000))
    def resubmit_whole_blocks(self, src: int) -> None:
        """Re-send a finished sequence cut to whole blocks: a full prefix match."""
        base = self.seen[src % len(self.seen)]
        n = min(len(base), FUZZ_MAX_LEN - 8) // FUZZ_BS * FUZZ_BS
        if n:
            self._new_request(list(base[:n]), False, ())

    def _admit(self, req: FakeRequest, chunk: int, token: int) -> bool:
        """Prefix lookup then allocation for a waiting request; False if it does not fit."""
        blocks, n = self.mgr.get_computed_blocks(req)
        assert n % FUZZ_BS == 0 and n < req.num_tokens and n == len(blocks) * FUZZ_BS
        # Every hit's KV must hold exactly this request's tokens.
        for i, blk in enumerate(blocks):
            assert self.kv[blk.block_id] == req.all_token_ids[i * FUZZ_BS : (i + 1) * FUZZ_BS]
        if req.skip_prefix_cache:
            assert n == 0
        if n:
            event("prefix hit")
        num_new = min(chunk, req.num_tokens - n)
        before = self._snapshot()
        new = self.mgr.allocate_slots(req, num_new, blocks, n)
        if new is None:
            assert self._snapshot() == before
            assert self.mgr.get_block_ids(req.request_id) == []
            event("waiting request did not fit")
            return False
        self._fresh(new)
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
    def pool_consistent(self) -> None:
        mgr = self.mgr
        pool = mgr.block_pool
        free = pool.free_block_queue.get_all_free_blocks()
        free_ids = {b.block_id for b in free}
        assert len(free_ids) == len(free) == pool.get_num_free_blocks()
        assert 0 not in free_ids and pool.null_block.ref_cnt == 0
        refs: dict[int, int] = {}
        for req in self.running:
            blocks = mgr.req_to_blocks.get(req.request_id, [])
            assert len(blocks) * FUZZ_BS >= req.num_computed_tokens
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for req in self.waiting:
            assert not mgr.req_to_blocks.get(req.request_id)
        assert 0 not in refs
        assert not (free_ids & refs.keys()), "a referenced block is in the free queue"
        assert len(free_ids) + len(refs) == pool.num_usable_blocks
        for b in pool.blocks:
            assert b.ref_cnt >= 0
            assert b.ref_cnt == refs.get(b.block_id, 0)
            if b.block_hash is not None:
                assert pool.cached_block_hash_to_block[b.block_hash] is b
        for h, b in pool.cached_block_hash_to_block.items():
            assert b.block_hash == h
            assert None not in self.kv[b.block_id]  # cached blocks hold a full block of KV

    @invariant()
    def hashes_match_tokens(self) -> None:
        for req in self.running:
            hashes = self.mgr.req_to_block_hashes.get(req.request_id, [])
            expected = hash_request_tokens(FUZZ_BS, req.all_token_ids, req.block_extra_keys)
            assert hashes == expected[: len(hashes)]
            # Every full block of computed, known tokens has been offered to the cache,
            # and a block indexed in the pool is indexed under this request's hash.
            num_full = min(req.num_computed_tokens, req.num_tokens) // FUZZ_BS
            assert self.mgr.num_cached_block.get(req.request_id, 0) == num_full
            for i, blk in enumerate(self.mgr.req_to_blocks[req.request_id][:num_full]):
                assert blk.block_hash in (None, expected[i])


KVCacheMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_kv_cache_state_machine = KVCacheMachine.TestCase
