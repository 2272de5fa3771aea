"""KV cache specs and groups: grouping layers, sharing tensors, and the manager over several groups (full
attention, sliding window, cross attention) drawing from one block pool, with a stateful fuzz."""

from __future__ import annotations

import logging
from typing import ClassVar

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from vllite_core.core.kv_cache_manager import KVCacheManager
from vllite_core.core.kv_cache_spec import (
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheGroup,
    SlidingWindowSpec,
    StateSpec,
    attention_specs,
    cdiv,
    group_layers,
    plan_kv_tensors,
)
from vllite_core.core.kv_cache_utils import hash_request_tokens
from vllite_core.request import Request
from vllite_core.sampling_params import SamplingParams

F16 = torch.float16


def full(bs: int = 4, heads: int = 2, head_size: int = 8, dtype=F16) -> FullAttentionSpec:
    return FullAttentionSpec(bs, heads, head_size, dtype)


def sliding(window: int, bs: int = 4, heads: int = 2, head_size: int = 8, dtype=F16) -> SlidingWindowSpec:
    return SlidingWindowSpec(bs, heads, head_size, dtype, sliding_window=window)


def cross(max_enc: int, bs: int = 4, heads: int = 2, head_size: int = 8, dtype=F16) -> CrossAttentionSpec:
    return CrossAttentionSpec(bs, heads, head_size, dtype, max_encoder_len=max_enc)


def make_request(rid: str, tokens: list[int], num_encoder_tokens: int = 0) -> Request:
    return Request(rid, list(tokens), SamplingParams(), num_encoder_tokens=num_encoder_tokens)


def real_ids(blocks) -> list[int]:
    return [b.block_id for b in blocks if not b.is_null]


def num_leading_null(blocks) -> int:
    n = 0
    while n < len(blocks) and blocks[n].is_null:
        n += 1
    return n


# ---- specs, grouping, tensor plan ------------------------------------------------------


def test_group_layers_equal_specs_group_in_first_appearance_order() -> None:
    specs = [sliding(8), full(), sliding(8), full(), cross(12), sliding(4), full(), cross(12)]
    groups = group_layers(specs)
    assert [g.spec for g in groups] == [sliding(8), full(), cross(12), sliding(4)]
    assert [g.layers for g in groups] == [(0, 2), (1, 3, 6), (4, 7), (5,)]
    # Equal means equal fields, not the same object; any field that differs splits a group.
    assert group_layers([full(), full(heads=4)])[1].layers == (1,)
    assert len(group_layers([full(), full(dtype=torch.float32)])) == 2
    assert len(group_layers([full()] * 5)) == 1
    assert group_layers([]) == []


def test_group_layers_rejects_mixed_block_sizes() -> None:
    with pytest.raises(ValueError, match="block size"):
        group_layers([full(bs=4), sliding(8, bs=16)])


def test_attention_specs_windows() -> None:
    specs = attention_specs(4, 16, 2, 8, F16, windows=[None, 32, None, 32])
    assert specs == [FullAttentionSpec(16, 2, 8, F16), SlidingWindowSpec(16, 2, 8, F16, sliding_window=32)] * 2
    assert [g.layers for g in group_layers(specs)] == [(0, 2), (1, 3)]
    assert attention_specs(2, 16, 2, 8, F16) == [FullAttentionSpec(16, 2, 8, F16)] * 2


def test_page_bytes_and_signature() -> None:
    spec = FullAttentionSpec(16, 8, 64, F16)
    assert spec.page_bytes == 2 * 16 * 8 * 64 * 2  # K and V
    assert FullAttentionSpec(16, 8, 64, torch.float32).page_bytes == 2 * spec.page_bytes
    # The signature ignores the kind: a full and a sliding layer of one geometry can share a tensor.
    assert sliding(8, bs=16, heads=8, head_size=64).page_signature == spec.page_signature
    assert cross(10, bs=16, heads=8, head_size=64).page_signature == spec.page_signature
    state = StateSpec(16, 1, 1, F16, state_bytes=1000)
    assert state.page_bytes == 1000
    assert state.page_signature == ("state", 1000) != spec.page_signature


def test_plan_shares_layer_k_of_groups_with_equal_signature() -> None:
    specs = [full(), full(), sliding(8), sliding(8)]
    plan = plan_kv_tensors(group_layers(specs), len(specs))
    assert plan.tensor_of_layer == (0, 1, 0, 1)
    assert plan.tensor_specs == (full(), full())
    assert plan.bytes_per_block == 2 * full().page_bytes == 2 * (2 * 4 * 2 * 8 * 2)


def test_plan_interleaved_and_uneven_groups() -> None:
    # Layer order does not matter, the position within the group does.
    specs = [full(), sliding(8), full(), full(), sliding(8)]
    plan = plan_kv_tensors(group_layers(specs), len(specs))
    # full: layers 0, 2, 3 at positions 0, 1, 2; sliding: layers 1, 4 at positions 0, 1.
    assert plan.tensor_of_layer == (0, 0, 1, 2, 1)
    assert len(plan.tensor_specs) == 3
    assert plan.bytes_per_block == 3 * full().page_bytes


def test_plan_different_signatures_do_not_share() -> None:
    big = cross(12, heads=4)
    specs = [full(), full(), big, big]
    plan = plan_kv_tensors(group_layers(specs), len(specs))
    assert plan.tensor_of_layer == (0, 1, 2, 3)
    assert plan.tensor_specs == (full(), full(), big, big)
    assert plan.bytes_per_block == 2 * full().page_bytes + 2 * big.page_bytes
    # Same geometry: the cross layers share the decoder layers' tensors.
    same = [full(), full(), cross(12), cross(12)]
    assert plan_kv_tensors(group_layers(same), 4).tensor_of_layer == (0, 1, 0, 1)
    # Another dtype, another tensor.
    mixed = [full(), sliding(8, dtype=torch.float32)]
    plan = plan_kv_tensors(group_layers(mixed), 2)
    assert plan.tensor_of_layer == (0, 1)
    assert plan.bytes_per_block == full().page_bytes + sliding(8, dtype=torch.float32).page_bytes
    state = StateSpec(4, 1, 1, F16, state_bytes=100)
    plan = plan_kv_tensors(group_layers([full(), state]), 2)
    assert plan.tensor_of_layer == (0, 1) and plan.bytes_per_block == full().page_bytes + 100


def test_plan_rejects_layer_without_group() -> None:
    with pytest.raises(ValueError, match="layer 2 belongs to no cache group"):
        plan_kv_tensors(group_layers([full(), full()]), 3)


@pytest.mark.parametrize(
    "bs,window,max_len,expected",
    [
        (4, 1, 100, 1),  # only the query's own position
        (4, 2, 100, 2),  # may straddle a block boundary
        (4, 4, 100, 2),
        (4, 5, 100, 2),  # 4 keys before the query fit in cdiv(4, 4) + 1 blocks
        (4, 6, 100, 3),
        (4, 8, 100, 3),
        (4, 9, 100, 3),
        (4, 10, 100, 4),
        (16, 32, 1000, 3),
        (16, 4096, 100, 7),  # capped by max_model_len
        (4, 8, 5, 2),
    ],
)
def test_sliding_window_max_blocks_per_request(bs: int, window: int, max_len: int, expected: int) -> None:
    assert sliding(window, bs=bs).max_blocks_per_request(max_len) == expected


@given(bs=st.integers(1, 16), window=st.integers(1, 64))
def test_sliding_window_bound_is_what_a_decode_holds(bs: int, window: int) -> None:
    """The bound equals the most blocks a decode step holds: the step at ``c`` computed tokens holds the
    blocks of slots [0, c + 1) minus those wholly before the window start ``c - window + 1``."""
    held = [cdiv(c + 1, bs) - max(0, (c - window + 1) // bs) for c in range(4 * (window + bs))]
    assert max(held) == sliding(window, bs=bs).max_blocks_per_request(10**9)


def test_other_specs_blocks_per_request() -> None:
    assert full().max_blocks_per_request(17) == 5
    c = cross(10)
    assert c.max_blocks_per_request(10**6) == 3
    assert c.blocks_per_request(make_request("r", [1], num_encoder_tokens=9)) == 3
    assert c.blocks_per_request(make_request("r", [1], num_encoder_tokens=0)) == 0
    s = StateSpec(4, 1, 1, F16, state_bytes=8)
    assert s.max_blocks_per_request(10**6) == 1 and s.blocks_per_request(make_request("r", [1])) == 1
    with pytest.raises(ValueError, match="sliding_window must be positive"):
        sliding(0)
    with pytest.raises(ValueError):
        sliding(-3)


# ---- manager over several groups: targeted tests --------------------------------------------


def manager(num_blocks: int, *specs, max_model_len: int | None = None, caching: bool = True) -> KVCacheManager:
    """A manager for layer specs given in order (each spec one layer, equal ones grouped)."""
    return KVCacheManager(num_blocks, specs[0].block_size, caching, max_model_len, groups=group_layers(list(specs)))


def test_uncacheable_group_turns_caching_off(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="vllite.kv_cache"):
        mgr = manager(20, full(), sliding(8), cross(12))
    assert not mgr.enable_caching and "cross_attention" in caplog.text
    assert not any(m.enable_caching for m in mgr.managers)
    r = make_request("r", list(range(10)), num_encoder_tokens=5)
    assert mgr.allocate_slots(r, 10) is not None
    r.num_computed_tokens = 10
    mgr.free(r)
    hit, n = mgr.get_computed_blocks(make_request("s", list(range(10)), num_encoder_tokens=5))
    assert hit.blocks == [[], [], []] and n == 0
    assert not mgr.block_pool.cached_block_hash_to_block and r.block_hashes == []
    # Without the cross group, caching stays on in every group.
    mgr = manager(20, full(), sliding(8))
    assert mgr.enable_caching and all(m.enable_caching for m in mgr.managers)


def test_groups_must_share_the_block_size() -> None:
    with pytest.raises(ValueError, match="block_size=8"):
        KVCacheManager(20, 8, groups=[KVCacheGroup(full(bs=4), (0,))])


def test_equal_tokens_in_two_groups_are_two_index_entries() -> None:
    mgr = manager(20, full(), sliding(100))
    r = make_request("r", list(range(9)))
    new = mgr.allocate_slots(r, 9)
    assert [len(ids) for ids in new] == [3, 3]
    assert set(new[0]).isdisjoint(new[1])
    pool = mgr.block_pool
    assert len(pool.cached_block_hash_to_block) == 4  # 2 full blocks in each group
    h = r.block_hashes
    assert pool.get_cached_block(h[0], 0).block_id == new[0][0]
    assert pool.get_cached_block(h[0], 1).block_id == new[1][0]
    mgr.check_integrity([r])


def test_cross_blocks_taken_at_admission_and_kept() -> None:
    mgr = manager(30, full(), cross(16))
    r = make_request("r", list(range(5)), num_encoder_tokens=10)
    new = mgr.allocate_slots(r, 2)  # a first chunk already takes the encoder's blocks
    assert [len(ids) for ids in new] == [1, 3]
    cross_ids = r.block_ids(1)
    r.num_computed_tokens = 2
    for t in range(20):  # prefill the rest, then decode
        assert mgr.allocate_slots(r, r.num_tokens - r.num_computed_tokens)[1] == []
        r.num_computed_tokens = r.num_tokens
        r.append_output_token_ids(t)
        assert r.block_ids(1) == cross_ids
    assert len(r.block_ids(0)) == cdiv(r.num_computed_tokens, 4)
    mgr.check_integrity([r])
    mgr.free(r)
    assert mgr.get_num_free_blocks() == mgr.num_usable_blocks
    mgr.check_integrity([])


def test_allocation_is_all_or_nothing_across_groups() -> None:
    mgr = manager(8, full(), sliding(8), cross(16))  # 7 usable
    holder = make_request("h", [1], num_encoder_tokens=0)
    big = make_request("b", list(range(8)), num_encoder_tokens=13)  # 2 + 2 + 4 blocks: one too many
    pool = mgr.block_pool
    before = ([(b.ref_cnt, b.block_hash) for b in pool.blocks], pool.free_block_queue.get_all_free_blocks())
    assert mgr.allocate_slots(big, 8) is None
    assert ([(b.ref_cnt, b.block_hash) for b in pool.blocks], pool.free_block_queue.get_all_free_blocks()) == before
    assert big.kv_blocks == [[], [], []]
    fits = make_request("f", list(range(8)), num_encoder_tokens=12)  # 2 + 2 + 3 = 7
    assert [len(ids) for ids in mgr.allocate_slots(fits, 8)] == [2, 2, 3]
    assert mgr.get_num_free_blocks() == 0
    assert mgr.allocate_slots(holder, 1) is None
    mgr.check_integrity([fits, big, holder])


def test_sliding_prefix_hit_nulls_blocks_out_of_the_window() -> None:
    mgr = manager(30, full(), sliding(4))
    a = make_request("a", list(range(17)))
    assert mgr.allocate_slots(a, 17) is not None
    a.num_computed_tokens = 17
    a_sliding = list(a.kv_blocks[1])
    a_full = a.block_ids(0)
    mgr.free(a)
    b = make_request("b", list(range(16)) + [99])
    hit, n = mgr.get_computed_blocks(b)
    assert n == 16 and hit.num_blocks == 4
    # The query at 16 reads keys 13..16: only the block [12, 16) of the hit is needed.
    assert [blk.is_null for blk in hit.blocks[1]] == [True, True, True, False]
    assert hit.blocks[1][3] is a_sliding[3]
    assert [blk.block_id for blk in hit.blocks[0]] == a_full[:4]
    new = mgr.allocate_slots(b, 1, hit, n)
    assert [len(ids) for ids in new] == [1, 1]
    assert num_leading_null(b.kv_blocks[1]) == 3 and len(b.kv_blocks[1]) == 5
    assert a_sliding[3].ref_cnt == 1 and all(blk.ref_cnt == 0 for blk in a_sliding[:3])
    mgr.check_integrity([b])


def test_sliding_blocks_released_as_the_window_moves() -> None:
    mgr = manager(30, full(), sliding(5))
    r = make_request("r", list(range(8)))
    assert mgr.allocate_slots(r, 8) is not None
    r.num_computed_tokens = 8
    r.append_output_token_ids(100)
    free_before = mgr.get_num_free_blocks()
    first = r.kv_blocks[1][0]
    # The query at 8 reads keys 4..8: block [0, 4) is dead and goes back to the pool, tail of the queue.
    assert r.block_ids(0) == [1, 2] and r.block_ids(1) == [3, 4]
    # Full attention takes its block first (5), then the sliding group (6): the released 3 sits behind them.
    assert mgr.allocate_slots(r, 1) == [[5], [6]]
    assert r.block_ids(1) == [0, 4, 6]
    assert r.kv_blocks[1][0].is_null and first.ref_cnt == 0
    assert mgr.get_num_free_blocks() == free_before - 2 + 1
    assert mgr.block_pool.free_block_queue.get_all_free_blocks()[-1] is first
    # Its hash stays in the index while it is free (another request may still hit it).
    assert mgr.block_pool.get_cached_block(r.block_hashes[0], 1) is first
    mgr.check_integrity([r])


def test_failed_allocation_still_releases_dead_sliding_blocks() -> None:
    """Documented in allocate_slots: the only side effect of a None is giving back out-of-window blocks."""
    mgr = manager(9, full(), sliding(5))  # 8 usable
    r = make_request("r", list(range(8)))
    assert mgr.allocate_slots(r, 8) is not None  # 2 + 2 blocks
    r.num_computed_tokens = 8
    r.append_output_token_ids(100)
    hog = make_request("h", [7] * 8)
    assert mgr.allocate_slots(hog, 8) is not None  # the other 4
    assert mgr.get_num_free_blocks() == 0
    dead = r.kv_blocks[1][0]
    table_full = r.block_ids(0)
    assert mgr.allocate_slots(r, 1) is None  # needs 2 new, only the dead one came back
    assert r.kv_blocks[1][0].is_null and dead.ref_cnt == 0
    assert r.block_ids(0) == table_full and len(r.kv_blocks[1]) == 2
    assert mgr.block_pool.free_block_queue.get_all_free_blocks() == [dead]
    mgr.check_integrity([r, hog])
    mgr.free(hog)
    assert [len(ids) for ids in mgr.allocate_slots(r, 1)] == [1, 1]
    mgr.check_integrity([r])


# Regression: allocate_slots once let each group take its hits and its fresh blocks in turn, so group 0's fresh
# allocation could pop from the free queue a free cached block that was group 1's prefix hit (not touched yet);
# one block id then sat in two groups' tables (and, as equal-geometry groups share cache tensors, their K/V
# overwrote each other). Now every group's hits are touched before any group allocates.
def test_fresh_blocks_never_take_another_groups_hit() -> None:
    mgr = manager(7, full(), sliding(5))  # 6 usable
    a = make_request("a", list(range(9)))
    assert mgr.allocate_slots(a, 9) == [[1, 2, 3], [4, 5, 6]]
    a.num_computed_tokens = 9
    a.append_output_token_ids(9)
    assert mgr.allocate_slots(a, 1) == [[], []]  # the window moved on: sliding block 4 (cached) is released
    mgr.free(a)
    # a's blocks without a hash (3, 6: the partial tails) went to the front, to be handed out first.
    assert [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()] == [6, 3, 4, 2, 1, 5]
    c = make_request("c", [77])
    assert mgr.allocate_slots(c, 1) == [[6], [3]]  # now the sliding group's cached block 4 is next out
    b = make_request("b", list(range(4)) + [99])
    hit, n = mgr.get_computed_blocks(b)
    assert n == 4 and [[blk.block_id for blk in h] for h in hit.blocks] == [[1], [4]]
    new = mgr.allocate_slots(b, 1, hit, n)
    assert new is not None
    full_ids, sliding_ids = mgr.get_block_ids(b)
    assert sliding_ids[0] == 4  # the hit
    assert set(full_ids).isdisjoint(sliding_ids), f"a block in both groups: {full_ids} {sliding_ids}"
    assert mgr.block_pool.blocks[4].ref_cnt == 1
    mgr.check_integrity([b, c])


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("bs,window", [(4, 8), (4, 1), (4, 5), (4, 9), (16, 40)])
def test_sliding_window_blocks_stay_bounded_over_a_long_decode(caching: bool, bs: int, window: int) -> None:
    """Decode 1,000 tokens: the full group grows by a block per ``bs`` tokens, the sliding group never holds
    more than ``max_blocks_per_request`` real blocks (reached: the bound is tight) and exactly the blocks of
    slots from the window start on."""
    num_decode, prompt_len = 1000, 5
    max_len = prompt_len + num_decode + 1
    sw = sliding(window, bs=bs)
    bound = sw.max_blocks_per_request(max_len)
    # A pool that fits the full group's blocks plus the bound, and not one block more.
    num_blocks = 1 + cdiv(max_len, bs) + bound
    mgr = manager(num_blocks, full(bs=bs), sw, max_model_len=max_len, caching=caching)
    r = make_request("r", list(range(prompt_len)))
    assert mgr.allocate_slots(r, prompt_len) is not None
    r.num_computed_tokens = prompt_len
    r.append_output_token_ids(0)
    most = 0
    for t in range(1, num_decode):
        c = r.num_computed_tokens
        assert mgr.allocate_slots(r, 1) is not None, f"pool exhausted at {c} tokens"
        held = real_ids(r.kv_blocks[1])
        assert len(r.block_ids(0)) == cdiv(c + 1, bs) == len(r.kv_blocks[1])
        assert num_leading_null(r.kv_blocks[1]) == max(0, (c - window + 1) // bs)
        assert len(held) == len(r.kv_blocks[1]) - num_leading_null(r.kv_blocks[1])  # nulls form a prefix
        assert len(held) <= bound
        most = max(most, len(held))
        assert mgr.num_usable_blocks - mgr.get_num_free_blocks() == len(r.block_ids(0)) + len(held)
        r.num_computed_tokens = c + 1
        r.append_output_token_ids(t % 7)
    assert most == bound
    assert len(r.block_ids(0)) == cdiv(r.num_computed_tokens, bs)
    mgr.check_integrity([r])
    mgr.free(r)
    mgr.check_integrity([])
    assert mgr.get_num_free_blocks() == mgr.num_usable_blocks


# ---- stateful fuzz over several groups -------------------------------------------------------

G_BS = 4
G_POOL = 20  # 19 usable; one request holds at most 9 full + 5 sliding (a 20-token chunk) + 3 cross
G_MAX_LEN = 36
G_MAX_ENC = 12
FULL, SLIDING, CROSS = 0, 1, 2


class GroupsMachine(RuleBasedStateMachine):
    """A toy scheduler over a full-attention, a sliding-window and (optionally) a cross-attention group.

    A shadow KV store ``{block_id: [token per slot]}`` is written as the toy scheduler "computes" tokens in
    each self-attention group; every prefix hit and every window the attention reads is checked against it.
    """

    WITH_CROSS: ClassVar[bool] = False

    def __init__(self) -> None:
        super().__init__()
        self.mgr: KVCacheManager | None = None
        self.window = 0
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.seen: list[list[int]] = [[]]
        self.next_id = 0
        self.kv: dict[int, list] = {}  # block id -> what each slot holds (None: not written)
        self.kv_group: dict[int, int] = {}  # block id -> the group it was last handed to
        # request id -> the computed-token count the last allocate_slots saw (it decides the sliding releases)
        self.last_alloc: dict[str, int] = {}

    @property
    def num_groups(self) -> int:
        return 3 if self.WITH_CROSS else 2

    # -- helpers --

    def _dead(self, num_computed: int) -> int:
        """Leading sliding blocks wholly before the next query's window."""
        return max(0, (num_computed - self.window + 1) // G_BS)

    def _new_request(self, prompt: list[int], enc: int, skip: bool = False) -> None:
        req = make_request(f"r{self.next_id}", prompt, num_encoder_tokens=enc if self.WITH_CROSS else 0)
        req.skip_prefix_cache = skip
        self.waiting.append(req)
        self.next_id += 1

    def _snapshot(self, req: Request) -> tuple:
        pool = self.mgr.block_pool
        return (
            [(b.ref_cnt, b.block_hash, b.group) for b in pool.blocks],
            [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
            sorted((k, b.block_id) for k, b in pool.cached_block_hash_to_block.items()),
            self.mgr.get_block_ids(req),
            list(req.num_cached_blocks),
        )

    def _predict_failed(self, req: Request, before: tuple) -> tuple:
        """The snapshot after a failed allocate_slots: only the dead sliding blocks went back, oldest first."""
        states, free, index, tables, cached = before
        states = list(states)
        free = list(free)
        tables = [list(t) for t in tables]
        if tables and tables[SLIDING]:
            dead = min(self._dead(req.num_computed_tokens), len(tables[SLIDING]))
            for i in range(dead):
                bid = tables[SLIDING][i]
                if bid == 0:
                    continue
                ref, h, g = states[bid]
                states[bid] = (ref - 1, h, g)
                if ref == 1:  # a block with no hash goes to the front (handed out first), a cached one last
                    free.insert(0, bid) if h is None else free.append(bid)
                tables[SLIDING][i] = 0
        return states, free, index, tables, cached

    def _fresh(self, req: Request, new: list[list[int]], cached_free: set[int]) -> None:
        assert len(new) == self.num_groups
        for g, ids in enumerate(new):
            if ids:
                assert req.block_ids(g)[-len(ids):] == ids, "fresh blocks go at the table's end"
            for bid in ids:
                assert bid != 0, "null block handed out"
                if bid in cached_free:
                    event("evicted a cached block")
                self.kv[bid] = [None] * G_BS
                self.kv_group[bid] = g
                if g == CROSS:
                    self.kv[bid] = ["encoder"] * G_BS  # the encoder's K/V, written at admission

    def _cached_free(self) -> set[int]:
        return {b.block_id for b in self.mgr.block_pool.free_block_queue.get_all_free_blocks()
                if b.block_hash is not None}

    def _compute(self, req: Request, start: int, end: int, token: int) -> None:
        """The forward pass over positions [start, end): write K/V, then check what attention reads."""
        tokens = req.all_token_ids
        for g in (FULL, SLIDING):
            blocks = req.kv_blocks[g]
            for pos in range(start, end):
                blk = blocks[pos // G_BS]
                assert not blk.is_null, f"group {g}: position {pos} would be written into the null block"
                self.kv[blk.block_id][pos % G_BS] = tokens[pos]
        # Full attention reads [0, q] for each query q; the sliding window [q - window + 1, q].
        for g, lo in ((FULL, 0), (SLIDING, max(0, start - self.window + 1))):
            blocks = req.kv_blocks[g]
            for pos in range(lo, end):
                blk = blocks[pos // G_BS]
                assert not blk.is_null, f"group {g}: key {pos} is read but its block was released"
                assert self.kv[blk.block_id][pos % G_BS] == tokens[pos], f"group {g}: key {pos} is wrong"
        req.num_computed_tokens = end
        if end == req.num_tokens:
            req.append_output_token_ids(token)  # prompt or decode done: sample one token
        if req.num_tokens >= G_MAX_LEN:
            self._release(req)

    def _release(self, req: Request) -> None:
        self.mgr.free(req)
        (self.waiting if req in self.waiting else self.running).remove(req)
        self.seen.append(list(req.all_token_ids))
        self.last_alloc.pop(req.request_id, None)
        assert req.kv_blocks == [] and req.num_cached_blocks == []

    def _preempt(self, req: Request) -> None:
        event("preempted")
        self.mgr.free(req)  # recompute preemption: release everything, back to the front of the queue
        req.num_computed_tokens = 0
        self.running.remove(req)
        self.waiting.insert(0, req)
        self.last_alloc.pop(req.request_id, None)

    def _admit(self, req: Request, chunk: int, token: int) -> bool:
        mgr = self.mgr
        hit, n = mgr.get_computed_blocks(req)
        assert len(hit.blocks) == self.num_groups
        assert n % G_BS == 0 and n < req.num_tokens
        if not mgr.enable_caching or req.skip_prefix_cache:
            assert n == 0 and hit.blocks == [[]] * self.num_groups
        k = n // G_BS
        assert hit.num_blocks == k and len(hit.blocks[FULL]) == len(hit.blocks[SLIDING]) == k
        tokens = req.all_token_ids
        for g in (FULL, SLIDING):
            for i, blk in enumerate(hit.blocks[g]):
                if g == SLIDING and i < self._dead(n):
                    assert blk.is_null, "a hit block no query reads was kept"
                    continue
                assert not blk.is_null
                assert self.kv_group[blk.block_id] == g, "a hit from another group's blocks"
                assert self.kv[blk.block_id] == list(tokens[i * G_BS:(i + 1) * G_BS]), "a hit holds other tokens"
        if self.WITH_CROSS:
            assert hit.blocks[CROSS] == []
        if n:
            event("prefix hit")
            if self._dead(n):
                event("prefix hit with out-of-window blocks nulled")
        num_new = min(chunk, req.num_tokens - n)
        before = self._snapshot(req)
        cached_free = self._cached_free()
        new = mgr.allocate_slots(req, num_new, hit, n)
        if new is None:
            # Holding nothing, the request has nothing to release: nothing changed at all.
            assert self._snapshot(req) == before
            assert req.kv_blocks == [[]] * self.num_groups
            event("waiting request did not fit")
            return False
        self._fresh(req, new, cached_free)
        for g in (FULL, SLIDING):
            assert req.kv_blocks[g][:k] == hit.blocks[g]
        if self.WITH_CROSS:
            assert len(new[CROSS]) == cdiv(req.num_encoder_tokens, G_BS)
            if new[CROSS]:
                event("cross blocks taken at admission")
        self.waiting.remove(req)
        self.running.append(req)
        self.last_alloc[req.request_id] = n
        self._compute(req, n, n + num_new, token)
        return True

    def _advance(self, req: Request, chunk: int, token: int) -> None:
        """One scheduled chunk for a running request; on a short pool preempt the newest request and retry."""
        mgr = self.mgr
        num_new = min(chunk, req.num_tokens - req.num_computed_tokens)
        assert num_new > 0
        while True:
            before = self._snapshot(req)
            cached_free = self._cached_free()
            nulls_before = num_leading_null(req.kv_blocks[SLIDING])
            new = mgr.allocate_slots(req, num_new)
            self.last_alloc[req.request_id] = req.num_computed_tokens
            if num_leading_null(req.kv_blocks[SLIDING]) > nulls_before:
                event("sliding blocks released")
            if new is not None:
                break
            after = self._snapshot(req)
            assert after == self._predict_failed(req, before)
            if after != before:
                event("failed allocation released sliding blocks")
            victim = self.running[-1]
            self._preempt(victim)
            if victim is req:
                return
        self._fresh(req, new, cached_free)
        if self.WITH_CROSS:
            assert new[CROSS] == []
        self._compute(req, req.num_computed_tokens, req.num_computed_tokens + num_new, token)

    # -- rules --

    @initialize(window=st.integers(5, 9), prompt=st.lists(st.integers(0, 2), min_size=9, max_size=20),
                n=st.integers(1, 3), enc=st.integers(0, G_MAX_ENC))
    def setup(self, window: int, prompt: list[int], n: int, enc: int) -> None:
        self.window = window
        specs = [full(), full(), sliding(window), sliding(window)]
        if self.WITH_CROSS:
            specs += [cross(G_MAX_ENC)] * 2
        groups = group_layers(specs)
        assert [g.layers for g in groups] == [(0, 1), (2, 3), (4, 5)][:self.num_groups]
        self.mgr = KVCacheManager(G_POOL, G_BS, max_model_len=G_MAX_LEN, groups=groups)
        assert self.mgr.enable_caching is (not self.WITH_CROSS)
        for i in range(n):  # a family sharing a prompt, so hits happen early
            self._new_request(prompt + [i], enc)

    @rule(src=st.integers(0, 1000), prefix_blocks=st.sampled_from([0, 1, 2, 3, 5, 9, 9]),
          suffix=st.lists(st.integers(0, 2), min_size=0, max_size=10), enc=st.integers(0, G_MAX_ENC),
          skip=st.sampled_from([False, False, False, True]))
    def add(self, src: int, prefix_blocks: int, suffix: list[int], enc: int, skip: bool) -> None:
        # Prefixes of live requests too: their early sliding blocks left the window and wait, free but
        # cached, near the front of the free queue.
        sources = self.seen + [list(r.all_token_ids) for r in self.running + self.waiting]
        base = sources[src % len(sources)]
        prompt = (base[:prefix_blocks * G_BS] + suffix)[:G_MAX_LEN - 6] or [0]
        self._new_request(prompt, enc, skip)

    @rule(src=st.integers(0, 1000), enc=st.integers(0, G_MAX_ENC))
    def resubmit_whole_blocks(self, src: int, enc: int) -> None:
        """Re-send a finished sequence cut to whole blocks: a full prefix match."""
        base = self.seen[src % len(self.seen)]
        n = min(len(base), G_MAX_LEN - 6) // G_BS * G_BS
        if n:
            self._new_request(list(base[:n]), enc)

    @rule(idx=st.integers(0, 1000), chunk=st.integers(1, 20), token=st.integers(0, 2))
    def schedule_waiting(self, idx: int, chunk: int, token: int) -> None:
        if self.waiting:
            self._admit(self.waiting[idx % len(self.waiting)], chunk, token)

    @rule(chunk=st.sampled_from([1, 1, 2, 4, 8]), token=st.integers(0, 2))
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

    @rule(idx=st.integers(0, 1000), tokens=st.lists(st.integers(0, 2), min_size=1, max_size=30))
    def decode_long(self, idx: int, tokens: list[int]) -> None:
        """One request decodes token by token (the sliding window moves, blocks come back)."""
        if not self.running:
            return
        req = self.running[idx % len(self.running)]
        for t in tokens:
            if req not in self.running:
                break
            self._advance(req, 1 if req.num_computed_tokens + 1 >= req.num_prompt_tokens else 20, t)

    @rule(idx=st.integers(0, 1000), chunk=st.integers(1, 20))
    def preempt_after_schedule(self, idx: int, chunk: int) -> None:
        """Schedule a chunk, then preempt the request before its KV is computed."""
        if not self.running:
            return
        req = self.running[idx % len(self.running)]
        cached_free = self._cached_free()
        new = self.mgr.allocate_slots(req, min(chunk, req.num_tokens - req.num_computed_tokens))
        if new is not None:
            self._fresh(req, new, cached_free)  # allocated, never written
        self._preempt(req)

    @rule(idx=st.integers(0, 1000))
    def finish(self, idx: int) -> None:
        if self.running:
            self._release(self.running[idx % len(self.running)])

    @rule(idx=st.integers(0, 1000))
    def abort_waiting(self, idx: int) -> None:
        """Aborting a waiting request (never admitted, or preempted) gives nothing back: it holds nothing."""
        if not self.waiting:
            return
        req = self.waiting[idx % len(self.waiting)]
        before = self._snapshot(req)[:3]
        self._release(req)
        assert self._snapshot(req)[:3] == before

    # -- invariants (after every step) --

    @precondition(lambda self: self.mgr is not None)
    @invariant()
    def pool_integrity(self) -> None:
        # (a) free + referenced = usable, every index entry on its own block, references = what requests hold.
        self.mgr.check_integrity(self.running + self.waiting)
        for (h, g), blk in self.mgr.block_pool.cached_block_hash_to_block.items():
            assert g in (FULL, SLIDING) and self.mgr.enable_caching
            assert self.kv_group[blk.block_id] == g, "indexed under a group that does not own it"
            assert None not in self.kv[blk.block_id], "an indexed block was never fully computed"

    @precondition(lambda self: self.mgr is not None)
    @invariant()
    def tables_match_specs(self) -> None:
        # (b) each request holds per group what its spec says.
        for req in self.waiting:
            assert not any(req.kv_blocks)
        for req in self.running:
            assert len(req.kv_blocks) == self.num_groups
            c = req.num_computed_tokens
            full_blocks, sw_blocks = req.kv_blocks[FULL], req.kv_blocks[SLIDING]
            assert len(full_blocks) == cdiv(c, G_BS) and not any(b.is_null for b in full_blocks)
            assert len(sw_blocks) == len(full_blocks)
            dead = min(self._dead(self.last_alloc[req.request_id]), len(sw_blocks))
            assert all(b.is_null for b in sw_blocks[:dead]), "a block out of the window was kept"
            assert not any(b.is_null for b in sw_blocks[dead:]), "a block in the window was released"
            if self.WITH_CROSS:
                cross_blocks = req.kv_blocks[CROSS]
                assert len(cross_blocks) == cdiv(req.num_encoder_tokens, G_BS)
                assert not any(b.is_null for b in cross_blocks) and all(b.ref_cnt == 1 for b in cross_blocks)
            if self.mgr.enable_caching:
                num_full = min(c, req.num_tokens) // G_BS
                assert req.num_cached_blocks == [num_full, num_full]
                assert req.block_hashes == hash_request_tokens(G_BS, list(req.all_token_ids))
            else:
                assert req.num_cached_blocks == [0] * self.num_groups and req.block_hashes == []

    @precondition(lambda self: self.mgr is not None)
    @invariant()
    def groups_never_share_a_block(self) -> None:
        # (e) a block id is held in one group only, and every held block was handed to that group.
        held: list[set[int]] = [set() for _ in range(self.num_groups)]
        for req in self.running:
            for g, blocks in enumerate(req.kv_blocks):
                ids = real_ids(blocks)
                assert len(set(ids)) == len(ids), "a block twice in one table"
                held[g].update(ids)
                for bid in ids:
                    assert self.kv_group[bid] == g
        for g in range(self.num_groups):
            for h in range(g + 1, self.num_groups):
                assert held[g].isdisjoint(held[h]), f"groups {g} and {h} hold a block at once"


class CachedGroupsMachine(GroupsMachine):
    """Full attention + sliding window: prefix caching on."""

    WITH_CROSS = False


class CrossGroupsMachine(GroupsMachine):
    """Full attention + sliding window + cross attention: prefix caching off (cross blocks are uncacheable)."""

    WITH_CROSS = True


_FUZZ_SETTINGS = settings(max_examples=300, stateful_step_count=50, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
CrossGroupsMachine.TestCase.settings = _FUZZ_SETTINGS
test_cross_groups_state_machine = CrossGroupsMachine.TestCase

CachedGroupsMachine.TestCase.settings = _FUZZ_SETTINGS
test_cached_groups_state_machine = CachedGroupsMachine.TestCase
