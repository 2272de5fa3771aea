"""Priority policy, preemption by recompute, concurrent partial prefills (scheduler level, fake runner)."""
from __future__ import annotations

from vllite_core.config import CacheConfig, SchedulerConfig
from vllite_core.core.kv_cache_manager import KVCacheManager
from vllite_core.core.scheduler import Scheduler
from vllite_core.request import Request, RequestStatus
from vllite_core.sampling_params import SamplingParams


def make(policy="fcfs", num_blocks=1000, budget=2048, max_seqs=256, max_len=16384, threshold=None):
    kv = KVCacheManager(num_blocks, 16, enable_caching=True, max_model_len=max_len)
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, policy=policy,
                          long_prefill_token_threshold=threshold)
    return Scheduler(cfg, CacheConfig(), kv, max_len)


_start = iter(range(1000, 10**9, 50_000))


def req(rid, n_prompt, max_tokens=8, priority=0, arrival=0.0):
    s = next(_start)
    return Request(rid, list(range(s, s + n_prompt)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   eos_token_id=2, priority=priority, arrival_time=arrival, max_tokens=max_tokens)


def step(s: Scheduler, finished_order: list[str] | None = None):
    out = s.schedule()
    sampled = {rid: [7] for rid in out.num_scheduled_tokens
               if s.requests[rid].num_computed_tokens >= s.requests[rid].num_tokens}
    reqs = {rid: s.requests[rid] for rid in sampled}
    s.update_from_output(out, sampled)
    if finished_order is not None:
        finished_order.extend(rid for rid, r in reqs.items() if r.status.finished)
    return out


def drain(s: Scheduler, limit=10_000):
    order: list[str] = []
    n = 0
    while s.has_unfinished_requests():
        step(s, order)
        n += 1
        assert n < limit
    return order


def test_priority_request_finishes_first_and_equal_priority_keeps_arrival_order():
    s = make("priority", max_seqs=2)
    for i in range(4):
        s.add_request(req(f"p0-{i}", 20, max_tokens=5, arrival=float(i)))
    step(s)  # saturated: two running, two waiting
    s.add_request(req("urgent", 20, max_tokens=5, priority=-1, arrival=10.0))
    order = drain(s)
    assert order.index("urgent") < order.index("p0-2") and order.index("urgent") < order.index("p0-3")
    assert order.index("p0-2") < order.index("p0-3")


def test_victim_is_last_by_priority_then_arrival():
    # 8 usable blocks (9 with the null block): three requests of 2 blocks each, then growth forces preemption.
    s = make("priority", num_blocks=9)
    reqs = [req("a", 30, max_tokens=40, priority=0, arrival=1.0),
            req("b", 30, max_tokens=40, priority=1, arrival=0.0),   # worst priority: the victim
            req("c", 30, max_tokens=40, priority=0, arrival=2.0)]
    for r in reqs:
        s.add_request(r)
    first_victim = None
    for _ in range(200):
        out = step(s)
        if out.preempted_req_ids and first_victim is None:
            first_victim = set(out.preempted_req_ids)
        if not s.has_unfinished_requests():
            break
    assert first_victim == {"b"}
    assert s.num_preemptions_total > 0
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in reqs)


def test_fcfs_victim_is_latest_arrival():
    s = make("fcfs", num_blocks=9)
    for rid in ("a", "b", "c"):
        s.add_request(req(rid, 30, max_tokens=40))
    victims = []
    while s.has_unfinished_requests():
        out = step(s)
        victims.extend(sorted(out.preempted_req_ids))
    assert victims and victims[0] == "c"


def test_new_high_priority_request_preempts_when_memory_is_short():
    s = make("priority", num_blocks=9)
    s.add_request(req("low1", 60, max_tokens=20, priority=5, arrival=0.0))
    s.add_request(req("low2", 60, max_tokens=20, priority=5, arrival=1.0))
    step(s)
    s.add_request(req("high", 60, max_tokens=3, priority=-1, arrival=2.0))
    out = step(s)
    assert "high" in out.num_scheduled_tokens and "low2" in out.preempted_req_ids
    order = drain(s)
    assert order[0] == "high"


def test_long_prompt_does_not_starve_short_ones():
    def first_token_steps(threshold):
        s = make("fcfs", max_len=16384, threshold=threshold)
        s.add_request(req("long", 8192, max_tokens=2))
        for i in range(16):
            s.add_request(req(f"s{i}", 40, max_tokens=2))
        seen: dict[str, int] = {}
        for n in range(1, 50):
            step(s)
            for rid, r in list(s.requests.items()):
                if r.num_output_tokens and rid not in seen:
                    seen[rid] = n
            if len(seen) == 17:
                break
        return seen

    capped = first_token_steps(None)  # default: long prefills capped at 4% of max_model_len
    assert max(capped[f"s{i}"] for i in range(16)) == 1
    uncapped = first_token_steps(0)
    assert min(uncapped[f"s{i}"] for i in range(16)) >= 4  # they waited behind the 8k prefill
    # The leftover budget went back to the long prompt: it is not slowed down by the cap.
    assert capped["long"] <= uncapped["long"] + 1


def test_at_most_max_num_partial_prefills_long_prompts_per_step():
    s = make("fcfs", max_len=16384, threshold=256)
    s.config.max_num_partial_prefills = 2
    for i in range(4):
        s.add_request(req(f"L{i}", 4000, max_tokens=1))
    out = s.schedule()
    assert len(out.num_scheduled_tokens) == 2


def test_abort_waiting_preempted_request_returns_blocks():
    s = make("fcfs", num_blocks=9)
    free0 = s.kv.get_num_free_blocks()
    for rid in ("a", "b", "c"):
        s.add_request(req(rid, 30, max_tokens=40))
    preempted = set()
    while not preempted:
        preempted = step(s).preempted_req_ids
    victim = next(iter(preempted))
    assert s.requests[victim].status == RequestStatus.PREEMPTED
    s.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
    drain(s)
    assert s.kv.get_num_free_blocks() == free0


def test_long_prefill_cap_never_leaves_budget_unused():
    # 64 prompts of 128 tokens with max_model_len 512 are all "long" (threshold 20): the cap must
    # only reorder work, so a 2048-token budget still prefills 16 of them per step, in arrival order.
    s = make("fcfs", max_len=512, budget=2048)
    for i in range(64):
        s.add_request(req(f"r{i}", 128, max_tokens=4))
    out = s.schedule()
    assert out.total_num_scheduled_tokens == 2048
    assert sorted(out.num_scheduled_tokens, key=lambda r: int(r[1:])) == [f"r{i}" for i in range(16)]
    assert set(out.num_scheduled_tokens.values()) == {128}
    assert s.waiting.peek().request_id == "r16"


def test_leftover_budget_reaches_long_prefills_without_a_slot():
    s = make("fcfs", max_len=16384, budget=512, threshold=64)
    s.config.max_num_partial_prefills = 3  # three long prefills start together...
    for rid, n in (("A", 100), ("B", 448), ("C", 1000), ("D", 1000)):
        s.add_request(req(rid, n, max_tokens=1))
    first = s.schedule()
    assert first.num_scheduled_tokens == {"A": 100, "B": 348, "C": 64}  # capped at 64, A and B topped up
    s.update_from_output(first, {})
    s.config.max_num_partial_prefills = 1  # ...then one slot: B holds it (capped, topped up to its 100 left)
    second = s.schedule()
    # the leftover goes to C (running) and would go on to D (waiting): nothing is left unused
    assert second.num_scheduled_tokens == {"B": 100, "C": 412}
    s.update_from_output(second, {})
    third = s.schedule()
    assert third.num_scheduled_tokens == {"C": 512}
    s.update_from_output(third, {})
    fourth = s.schedule()
    assert fourth.num_scheduled_tokens == {"C": 12, "D": 500}
