"""Unified scheduler: token budget, chunked prefill, joins/leaves, stop rules (no model needed)."""
from __future__ import annotations

from vllite_core.config import CacheConfig, SchedulerConfig
from vllite_core.core.kv_cache_manager import KVCacheManager
from vllite_core.core.scheduler import Scheduler
from vllite_core.request import Request, RequestStatus
from vllite_core.sampling_params import SamplingParams


def make_scheduler(num_blocks=1000, budget=2048, max_seqs=256, chunked=True, caching=True, max_len=16384):
    kv = KVCacheManager(num_blocks, 16, enable_caching=caching, max_model_len=max_len)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                     enable_chunked_prefill=chunked), CacheConfig(), kv, max_len)


def req(rid, n_prompt, max_tokens=8, start=100, **kw):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=kw.pop("ignore_eos", True), **kw)
    return Request(rid, list(range(start, start + n_prompt)), params, eos_token_id=2, max_tokens=max_tokens)


def run_step(s: Scheduler, token=7):
    out = s.schedule()
    # A fake runner: every request that has computed all its known tokens samples `token`.
    sampled = {rid: [token] for rid, n in out.num_scheduled_tokens.items()
               if s.requests[rid].num_computed_tokens >= s.requests[rid].num_tokens}
    s.update_from_output(out, sampled)
    return out


def test_budget_splits_long_prompt_while_decodes_continue():
    s = make_scheduler(budget=512)
    s.add_request(req("short", 10, max_tokens=50))
    run_step(s)  # prefill of the short one
    s.add_request(req("long", 10_000, max_tokens=4, start=1000))
    steps = 0
    while s.requests.get("long") and s.requests["long"].num_output_tokens == 0:
        out = run_step(s)
        steps += 1
        assert out.total_num_scheduled_tokens <= 512
        if "short" in out.num_scheduled_tokens:
            assert out.num_scheduled_tokens["short"] == 1  # the decode kept flowing
    assert steps == -(-10_000 // 511)  # 511 prefill tokens + 1 decode token per step
    assert s.requests["short"].num_output_tokens == 1 + steps


def test_chunked_prefill_off_admits_whole_prompts_only():
    s = make_scheduler(budget=100, chunked=False, max_len=100)
    s.add_request(req("a", 60))
    s.add_request(req("b", 60, start=5000))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 60}


def test_max_num_seqs_and_join_leave():
    s = make_scheduler(max_seqs=2)
    for i in range(3):
        s.add_request(req(f"r{i}", 5, max_tokens=2))
    out = run_step(s)
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}
    out = run_step(s)  # r0, r1 decode their 2nd token and finish
    assert s.requests.get("r0") is None and s.requests.get("r1") is None
    out = run_step(s)
    assert set(out.num_scheduled_tokens) == {"r2"}
    assert out.finished_req_ids == {"r0", "r1"}


def test_stop_rules():
    s = make_scheduler()
    r_eos = req("eos", 5, max_tokens=10, ignore_eos=False)
    r_stop_id = req("stopid", 5, max_tokens=10, stop_token_ids=[9])
    r_min = req("min", 5, max_tokens=10, ignore_eos=False, min_tokens=3)
    for r in (r_eos, r_stop_id, r_min):
        s.add_request(r)
    out = s.schedule()
    s.update_from_output(out, {"eos": [2], "stopid": [9], "min": [2]})
    assert r_eos.status == RequestStatus.FINISHED_STOPPED and r_eos.stop_reason is None
    assert r_stop_id.status == RequestStatus.FINISHED_STOPPED and r_stop_id.stop_reason == 9
    assert r_min.status == RequestStatus.RUNNING  # EOS ignored before min_tokens
    for _ in range(2):
        out = s.schedule()
        s.update_from_output(out, {"min": [2]})
    assert r_min.status == RequestStatus.FINISHED_STOPPED and r_min.num_output_tokens == 3


def test_max_tokens_and_max_model_len_cap():
    s = make_scheduler(max_len=20)
    r = req("a", 15, max_tokens=100)
    r.max_tokens = 5
    s.add_request(r)
    while s.has_unfinished_requests():
        run_step(s)
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED and r.num_tokens == 20


def test_prefix_cache_hit_is_not_rescheduled():
    s = make_scheduler()
    s.add_request(req("a", 64, max_tokens=1))
    while s.has_unfinished_requests():
        run_step(s)
    s.add_request(req("b", 70, max_tokens=1))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"b": 70 - 64}
    assert s.requests["b"].num_cached_tokens == 64


def test_abort_frees_blocks():
    s = make_scheduler(num_blocks=50)
    free0 = s.kv.get_num_free_blocks()
    s.add_request(req("a", 100, max_tokens=50))
    s.add_request(req("b", 30, max_tokens=50, start=5000))
    run_step(s)
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert s.requests.get("a") is None
    s.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert s.kv.get_num_free_blocks() == free0
    assert not s.has_unfinished_requests()


def make_pp_scheduler(num_blocks=1000, budget=2048):
    kv = KVCacheManager(num_blocks, 16, enable_caching=False, max_model_len=4096)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=256), CacheConfig(), kv, 4096,
                     pipeline_parallel=True)


def test_pipeline_stages_never_reschedule_a_request_in_flight():
    """Two batches in flight (pipeline stages): the second leaves out the requests of the first until its
    output came back, and each step names the tokens it computes (the sampled one included)."""
    s = make_pp_scheduler()
    s.add_request(req("a", 20))
    first = s.schedule()
    s.add_request(req("b", 10, start=500))
    second = s.schedule()
    assert set(first.num_scheduled_tokens) == {"a"} and set(second.num_scheduled_tokens) == {"b"}
    assert s.schedule().is_empty  # both in flight
    s.update_from_output(first, {"a": [7]})
    third = s.schedule()
    assert third.num_scheduled_tokens == {"a": 1}
    (cached,) = third.scheduled_cached_reqs
    assert (cached.num_computed_tokens, cached.token_ids) == (20, [7])


def test_pipeline_stages_never_preempt_a_request_in_flight():
    """Out of blocks, a request preempts itself rather than one whose step is still running."""
    s = make_pp_scheduler(num_blocks=4)  # 3 usable blocks of 16 tokens
    s.add_request(req("a", 32))
    first = s.schedule()  # a: 2 blocks
    s.add_request(req("b", 16, start=500))
    second = s.schedule()  # b: the last block, in flight
    s.update_from_output(first, {"a": [7]})
    third = s.schedule()  # a's 33rd token needs a block: only b holds one, and b is in flight
    assert third.preempted_req_ids == {"a"} and third.is_empty
    assert s.requests["b"].status == RequestStatus.RUNNING
    s.update_from_output(second, {"b": [7]})


def test_pipeline_stages_abort_a_request_in_flight():
    """Aborted while its step runs: its blocks are freed at once, its step's token is dropped when it comes back,
    and the next step tells the runner it finished."""
    s = make_pp_scheduler()
    s.add_request(req("a", 20))
    s.add_request(req("b", 10, start=500))
    first = s.schedule()
    s.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert s.kv.get_num_free_blocks() == 999 - 2  # a's two blocks left
    updated = s.update_from_output(first, {"a": [7], "b": [7]})
    assert [r.request_id for r in updated] == ["a"] and not s.in_flight
    nxt = s.schedule()
    assert nxt.num_scheduled_tokens == {"a": 1} and nxt.finished_req_ids == {"b"}
