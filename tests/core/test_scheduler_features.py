"""The scheduler's feature paths with fake runner outputs (no model), as vLLM's tests/v1/core does:
speculative drafts, jump-forward, LoRA admission, the wait for a grammar, the encoder budget.

Each test plays the runner's part by hand (what it sampled, which drafts it proposed) and checks the
scheduler's decisions against counts worked out in the test."""
from __future__ import annotations

from dataclasses import dataclass, field

from test_scheduler import make_scheduler, req

from vllite_core.config import CacheConfig, SchedulerConfig
from vllite_core.core.kv_cache_manager import KVCacheManager
from vllite_core.core.scheduler import Scheduler
from vllite_core.multimodal.encoder_cache import EncoderCacheManager
from vllite_core.multimodal.features import MultiModalFeature
from vllite_core.request import Request, RequestStatus


def spec_scheduler(k: int, budget: int = 2048, max_len: int = 16384) -> Scheduler:
    kv = KVCacheManager(1000, 16, enable_caching=True, max_model_len=max_len, num_lookahead_tokens=k)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget), CacheConfig(), kv, max_len, num_spec_tokens=k)


def prefill(s: Scheduler, rid: str, token: int, drafts: list[int] | None = None) -> None:
    """One step that prefills everything waiting; ``rid`` samples ``token`` and proposes ``drafts``."""
    out = s.schedule()
    assert rid in out.num_scheduled_tokens
    s.update_from_output(out, {rid: [token]}, spec_token_ids={rid: drafts} if drafts is not None else None)


# ---- speculative decoding ------------------------------------------------------------------------
def test_drafts_are_scheduled_verified_and_rejected_positions_recomputed():
    s = spec_scheduler(k=3)
    r = req("r", 10, max_tokens=20)
    s.add_request(r)
    prefill(s, "r", 50, drafts=[60, 61, 62])
    assert r.spec_token_ids == [60, 61, 62] and r.num_computed_tokens == 10
    out = s.schedule()
    # The last sampled token and the three drafts after it, drafts named for the runner to verify.
    assert out.num_scheduled_tokens == {"r": 4} and out.scheduled_spec_decode_tokens == {"r": [60, 61, 62]}
    assert r.num_computed_tokens == 14
    # The runner accepted the first draft and sampled 70 after it: two tokens, two positions to redo.
    s.update_from_output(out, {"r": [60, 70]}, spec_token_ids={"r": [80, 81, 82]})
    assert list(r.output_token_ids) == [50, 60, 70]
    assert r.num_computed_tokens == 12  # 10 prompt + 50 + 60 computed; 70 is computed next step
    sd = s.stats().spec_decoding
    assert (sd.num_drafts, sd.num_draft_tokens, sd.num_accepted_tokens) == (1, 3, 1)
    assert sd.num_accepted_tokens_per_pos == [1, 0, 0]
    out = s.schedule()
    assert out.num_scheduled_tokens == {"r": 4} and out.scheduled_spec_decode_tokens == {"r": [80, 81, 82]}


def test_drafts_never_overshoot_max_tokens_and_stop_inside_the_accepted_ones():
    s = spec_scheduler(k=3)
    r = req("r", 10, max_tokens=3, ignore_eos=False)
    s.add_request(r)
    prefill(s, "r", 50, drafts=[60, 61, 62])
    # Two more tokens allowed: one draft (plus the token sampled after it) is all that may be verified.
    assert r.spec_token_ids == [60]
    s2 = spec_scheduler(k=3)
    stop = req("stop", 10, max_tokens=20, ignore_eos=False)
    s2.add_request(stop)
    prefill(s2, "stop", 50, drafts=[2, 61, 62])
    out = s2.schedule()
    tokens = [2, 61, 62, 63]  # every draft accepted, but the first is EOS (eos_token_id=2)
    s2.update_from_output(out, {"stop": tokens})
    assert tokens == [2] and list(stop.output_token_ids) == [50, 2]  # nothing after the stop is output
    assert stop.status == RequestStatus.FINISHED_STOPPED and "stop" not in s2.requests


def test_the_budget_cuts_drafts_short():
    s = spec_scheduler(k=4, budget=3)
    r = req("r", 2, max_tokens=20)
    s.add_request(r)
    prefill(s, "r", 50, drafts=[60, 61, 62, 63])
    out = s.schedule()
    assert out.num_scheduled_tokens == {"r": 3} and out.scheduled_spec_decode_tokens == {"r": [60, 61]}


def test_a_preempted_request_drops_its_drafts():
    s = spec_scheduler(k=2)
    r = req("r", 10, max_tokens=20)
    s.add_request(r)
    prefill(s, "r", 50, drafts=[60, 61])
    s._preempt(r)
    assert r.spec_token_ids == [] and r.status == RequestStatus.PREEMPTED
    out = s.schedule()
    assert out.num_scheduled_tokens == {"r": 11} and not out.scheduled_spec_decode_tokens


# ---- structured output: a fake grammar -----------------------------------------------------------
@dataclass
class FakeGrammar:
    """A RequestGrammar stand-in: ``forced[i]`` is the only token allowed after i accepted tokens (None:
    several allowed); it terminates after ``length`` tokens; compiled once ``ready`` is set."""

    forced: dict[int, int] = field(default_factory=dict)
    length: int = 100
    ready: bool = True
    error: str | None = None
    jump_forward: bool = True
    accepted: list[int] = field(default_factory=list)

    @property
    def matcher(self) -> object | None:
        return object() if self.ready else None

    def poll(self) -> bool:
        return self.ready

    def accept(self, token_id: int) -> bool:
        want = self.forced.get(len(self.accepted))
        self.accepted.append(token_id)
        return want is None or want == token_id

    def forced_token(self) -> int | None:
        return self.forced.get(len(self.accepted))

    def is_terminated(self) -> bool:
        return len(self.accepted) >= self.length


def structured(rid: str, n_prompt: int, grammar: FakeGrammar, max_tokens: int = 20, **kw) -> Request:
    r = req(rid, n_prompt, max_tokens=max_tokens, **kw)
    r.structured_output = grammar
    return r


def test_jump_forward_appends_forced_tokens_and_the_runner_gets_them_next_step():
    s = make_scheduler()
    g = FakeGrammar(forced={1: 5, 2: 6})  # after the first sampled token, the grammar forces 5 then 6
    r = structured("r", 10, g)
    s.add_request(r)
    out = s.schedule()
    tokens = [7]
    s.update_from_output(out, {"r": tokens})
    assert tokens == [7, 5, 6] and list(r.output_token_ids) == [7, 5, 6] and g.accepted == [7, 5, 6]
    assert r.jumped_token_ids == [5, 6] and s.stats().num_jump_forward_tokens == 2
    out = s.schedule()
    # The sampled token and the two jumped ones are computed together; the runner is told the jumped ones.
    assert out.num_scheduled_tokens == {"r": 3}
    assert [c.new_token_ids for c in out.scheduled_cached_reqs] == [[5, 6]] and r.jumped_token_ids == []


def test_jump_forward_stops_at_max_tokens_and_finishes_a_complete_grammar():
    s = make_scheduler()
    capped = structured("capped", 10, FakeGrammar(forced={1: 5, 2: 6, 3: 7}), max_tokens=3)
    done = structured("done", 10, FakeGrammar(forced={1: 5}, length=2), start=500)
    s.add_request(capped)
    s.add_request(done)
    out = s.schedule()
    s.update_from_output(out, {"capped": [9], "done": [9]})
    assert list(capped.output_token_ids) == [9, 5, 6] and capped.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert list(done.output_token_ids) == [9, 5] and done.status == RequestStatus.FINISHED_STOPPED
    assert s.stats().num_jump_forward_tokens == 3 and not s.requests


def test_no_jump_for_a_request_that_asks_for_logprobs():
    s = make_scheduler()
    r = structured("r", 10, FakeGrammar(forced={1: 5}), logprobs=1)
    s.add_request(r)
    out = s.schedule()
    s.update_from_output(out, {"r": [7]})
    assert list(r.output_token_ids) == [7] and s.stats().num_jump_forward_tokens == 0


def test_a_token_the_grammar_refuses_fails_the_request():
    s = make_scheduler()
    r = structured("r", 10, FakeGrammar(forced={0: 5}, jump_forward=False))
    s.add_request(r)
    out = s.schedule()
    s.update_from_output(out, {"r": [7]})
    assert r.status == RequestStatus.FINISHED_ERROR and "token 7" in s.grammar_errors["r"]


# ---- the wait for a grammar ------------------------------------------------------------------------
def test_a_request_waits_for_its_grammar_while_the_others_run():
    s = make_scheduler()
    g = FakeGrammar(ready=False)
    slow = structured("slow", 10, g)
    slow.status = RequestStatus.WAITING_FOR_FSM
    s.add_request(slow)
    s.add_request(req("free", 10, start=500))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"free": 10}
    assert slow.status == RequestStatus.WAITING_FOR_FSM and s.waiting.peek() is slow  # still first in line
    s.update_from_output(out, {"free": [7]})
    g.ready = True
    out = s.schedule()
    assert out.num_scheduled_tokens == {"free": 1, "slow": 10} and slow.status == RequestStatus.RUNNING


def test_a_grammar_that_fails_to_compile_fails_its_request_while_it_waits():
    s = make_scheduler()
    g = FakeGrammar(ready=False, error="structured_outputs: the xgrammar grammar did not compile in time")
    bad = structured("bad", 10, g)
    bad.status = RequestStatus.WAITING_FOR_FSM
    s.add_request(bad)
    out = s.schedule()
    assert out.is_empty and s.grammar_errors == {"bad": g.error}
    updated = s.update_from_output(out, {})
    assert updated == [bad] and bad.status == RequestStatus.FINISHED_ERROR
    assert not s.has_unfinished_requests() and "bad" not in s.requests


# ---- LoRA admission ---------------------------------------------------------------------------------
def lora_req(rid: str, lora_id: int, start: int) -> Request:
    """A request running adapter ``lora_id`` (0: the base model); the scheduler reads only its id."""
    from vllite_core.lora.request import LoRARequest

    r = req(rid, 8, max_tokens=2, start=start)
    r.lora_request = LoRARequest(f"adapter{lora_id}", lora_id, "/unused") if lora_id else None
    return r


def test_lora_admission_keeps_to_max_loras_and_skipped_requests_keep_their_place():
    kv = KVCacheManager(1000, 16, enable_caching=True, max_model_len=1024)
    s = Scheduler(SchedulerConfig(), CacheConfig(), kv, 1024, max_loras=1)
    s.add_request(lora_req("a1", 1, 100))
    s.add_request(lora_req("b2", 2, 200))
    s.add_request(lora_req("c1", 1, 300))
    s.add_request(lora_req("base", 0, 400))
    out = s.schedule()
    # One adapter slot: adapter 1 runs, adapter 2 waits, the base model needs no slot.
    assert set(out.num_scheduled_tokens) == {"a1", "c1", "base"}
    assert [r.request_id for r in s.waiting] == ["b2"]
    s.update_from_output(out, {rid: [7] for rid in out.num_scheduled_tokens})
    out = s.schedule()
    assert "b2" not in out.num_scheduled_tokens
    s.update_from_output(out, {rid: [7] for rid in out.num_scheduled_tokens})  # max_tokens=2: all finish
    out = s.schedule()
    assert out.num_scheduled_tokens == {"b2": 8}


# ---- the encoder budget ------------------------------------------------------------------------------
def image(mm_hash: str, offset: int, length: int = 4) -> MultiModalFeature:
    return MultiModalFeature("image", mm_hash, offset, length)


def mm_scheduler(cache_rows: int, step_rows: int, chunked: bool = True) -> Scheduler:
    kv = KVCacheManager(1000, 16, enable_caching=False, max_model_len=1024)
    return Scheduler(SchedulerConfig(enable_chunked_prefill=chunked, max_num_batched_tokens=1024), CacheConfig(),
                     kv, 1024, encoder_cache=EncoderCacheManager(cache_size=cache_rows, budget=step_rows))


def mm_req(rid: str, images: list[MultiModalFeature], n_prompt: int = 20, start: int = 100) -> Request:
    r = req(rid, n_prompt, start=start)
    r.mm_features = images
    return r


def test_the_encoder_budget_stops_a_prefill_before_an_image_that_does_not_fit():
    s = mm_scheduler(cache_rows=16, step_rows=4)
    r = mm_req("r", [image("h1", 2), image("h2", 10)])
    s.add_request(r)
    out = s.schedule()
    # Four encoder rows a step: h1's, then the range stops where h2 begins.
    assert out.num_scheduled_tokens == {"r": 10} and [f.identifier for f in out.scheduled_encoder_inputs] == ["h1"]
    s.update_from_output(out, {})
    out = s.schedule()
    assert out.num_scheduled_tokens == {"r": 10} and [f.identifier for f in out.scheduled_encoder_inputs] == ["h2"]
    stats = s.stats().mm_cache
    assert (stats.queries, stats.hits) == (2, 0)


def test_images_a_prefill_has_passed_make_room_for_the_next_adjacent_one():
    """InternVL's tiles: adjacent items in a cache of two. The references on the two passed ones are dropped before
    the next step is planned, so the third is encoded there (holding them would stall the prefill for good)."""
    s = mm_scheduler(cache_rows=8, step_rows=8)
    r = mm_req("r", [image("t0", 2), image("t1", 6), image("t2", 10)])
    s.add_request(r)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"r": 10}
    assert [f.identifier for f in out.scheduled_encoder_inputs] == ["t0", "t1"]
    s.update_from_output(out, {})
    out = s.schedule()
    assert out.num_scheduled_tokens == {"r": 10} and [f.identifier for f in out.scheduled_encoder_inputs] == ["t2"]


def test_an_image_already_encoded_costs_no_budget_and_counts_as_a_hit():
    s = mm_scheduler(cache_rows=16, step_rows=4)
    s.add_request(mm_req("a", [image("h1", 2)]))
    s.add_request(mm_req("b", [image("h1", 2)], start=500))
    out = s.schedule()
    # Both prompts run whole: "b" reuses the output "a" encodes in the same step.
    assert out.num_scheduled_tokens == {"a": 20, "b": 20}
    assert [f.identifier for f in out.scheduled_encoder_inputs] == ["h1"]
    stats = s.stats().mm_cache
    assert (stats.queries, stats.hits) == (2, 1)


def test_without_chunked_prefill_a_prompt_whose_images_do_not_fit_waits():
    s = mm_scheduler(cache_rows=16, step_rows=4, chunked=False)
    s.add_request(mm_req("two", [image("h1", 2), image("h2", 10)]))
    s.add_request(mm_req("one", [image("h3", 2)], start=500))
    out = s.schedule()
    assert "two" not in out.num_scheduled_tokens  # eight rows never fit a step of four: all or nothing
