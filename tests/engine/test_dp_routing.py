"""The data-parallel router's choice (dp_routing.py): the least loaded engine core unless another holds the
prompt's prefix within the load slack; keys per full block, chained, separated by salt / adapter."""
from __future__ import annotations

from vllite_core.engine.dp_routing import PrefixRouter

BS = 4
PREFIX = list(range(100, 112))  # three full blocks


def test_a_shared_prefix_follows_its_engine_within_the_slack():
    r = PrefixRouter(BS, slack=2)
    keys = r.prefix_keys(PREFIX + [1, 2], None)
    assert len(keys) == 3  # the two tokens past the last full block make no key
    assert r.choose(keys, {0: 3, 1: 0}) == 1  # nothing remembered: the least loaded
    again = r.prefix_keys(PREFIX + [5], None)
    assert again == keys
    assert r.choose(again, {0: 0, 1: 2}) == 1  # engine 1 holds it, 2 more requests: within the slack
    assert r.choose(again, {0: 0, 1: 3}) == 0  # past the slack: the least loaded, which now holds it
    assert r.choose(again, {0: 1, 1: 0}) == 0


def test_the_longest_remembered_prefix_decides_and_ties_go_to_the_lowest_index():
    r = PrefixRouter(BS, slack=8)
    short = r.prefix_keys(PREFIX[:4], None)
    assert r.choose(short, {0: 0, 1: 0}) == 0
    longer = r.prefix_keys(PREFIX, None)
    assert longer[0] == short[0]
    assert r.choose(longer, {0: 5, 1: 0}) == 0  # its first block is on 0
    other = r.prefix_keys(PREFIX[:8] + [1, 1, 1, 1], None)
    assert r.choose(other, {0: 1, 1: 0}) == 0  # shares two blocks with the one on 0
    # a prefix that is on engine 1 only after its first block
    r2 = PrefixRouter(BS, slack=0)
    assert r2.choose(r2.prefix_keys(PREFIX, None), {0: 1, 1: 0}) == 1
    assert r2.choose(r2.prefix_keys(PREFIX[:4], None), {0: 0, 1: 0}) == 1  # ties within the slack: affinity


def test_salt_adapter_and_a_dead_engine_separate_prefixes():
    r = PrefixRouter(BS)
    assert r.prefix_keys(PREFIX, ("salt-a", None)) != r.prefix_keys(PREFIX, ("salt-b", None))
    assert r.prefix_keys(PREFIX, (None, "adapter")) != r.prefix_keys(PREFIX, (None, None))
    keys = r.prefix_keys(PREFIX, ("salt-a", None))
    assert r.choose(keys, {0: 1, 1: 0}) == 1
    assert r.choose(r.prefix_keys(PREFIX, ("salt-b", None)), {0: 0, 1: 1}) == 0  # not the other tenant's
    assert r.choose(keys, {0: 0}) == 0  # engine 1 is not live: the live ones only
    r.forget_engine(0)
    assert r.choose(keys, {0: 0, 1: 1}) == 0  # forgotten with engine 0: least loaded again...
    assert r.choose(keys, {0: 2, 1: 0}) == 0  # ...and remembered there


def test_memory_is_bounded():
    r = PrefixRouter(BS, capacity=10, max_blocks=2)
    for i in range(20):
        assert len(r.prefix_keys([i] * 40, None)) == 2
        r.choose(r.prefix_keys([i] * 40, None), {0: 0})
    assert len(r._holder) == 10
