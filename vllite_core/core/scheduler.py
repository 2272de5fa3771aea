"""The unified token-budget scheduler.

Each step hands every request a number of tokens out of one budget. A running
request needs ``num_tokens - num_computed_tokens`` (one while decoding, a chunk
while prefilling); waiting requests are admitted while budget, sequence slots and
KV blocks last. The scheduler only decides: blocks are tracked by the
KVCacheManager and tensors live in the model runner.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

from vllite_core.config import CacheConfig, SchedulerConfig
from vllite_core.core.kv_cache_manager import KVCacheManager
from vllite_core.core.request_queue import create_request_queue
from vllite_core.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from vllite_core.core.stats import SchedulerStats, StepTimes
from vllite_core.request import Request, RequestStatus
from vllite_core.spec_decode.metrics import SpecDecodingStats
from vllite_core.structured_output.jump_forward import can_jump, next_forced_token

logger = logging.getLogger("vllite.scheduler")


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 kv_cache_manager: KVCacheManager, max_model_len: int, max_loras: int = 0,
                 encoder_cache: Any = None, num_spec_tokens: int = 0, pipeline_parallel: bool = False) -> None:
        self.config = scheduler_config
        self.max_loras = max_loras  # distinct LoRA adapters among running requests (0: LoRA off)
        self.cache_config = cache_config
        self.kv = kv_cache_manager
        # Multimodal models: the encoder cache (vllite_core.multimodal.encoder_cache.EncoderCacheManager).
        self.encoder_cache = encoder_cache
        self.max_model_len = max_model_len
        self.policy = scheduler_config.policy
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.num_preemptions_total = 0
        # Structured output faults found outside the model (a grammar that failed to compile, a token its
        # grammar refuses): request id -> reason; the core reports them with the step's failures.
        self.grammar_errors: dict[str, str] = {}
        # Speculative decoding (num_spec_tokens > 0): drafts are scheduled tokens, counted here once verified.
        self.spec_stats = SpecDecodingStats(num_spec_tokens) if num_spec_tokens else None
        self.num_jump_forward_tokens = 0
        # Pipeline stages (several batches in flight): the requests whose step has not come back yet are not
        # scheduled again (or preempted) until it has; each step names the tokens it computes, as the stages
        # that do not sample do not know the last sampled ones.
        self.pipeline_parallel = pipeline_parallel
        self.in_flight: set[str] = set()

    # ---- intake -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: str | list[str], status: RequestStatus) -> list[Request]:
        """End requests from outside the step (abort, stop string): free their blocks now."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.status.finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.status = status
            self._free(req)
            done.append(req)
        return done

    def _free(self, req: Request) -> None:
        self.kv.free(req)
        if self.encoder_cache is not None:
            self.encoder_cache.release_all(req)
        self.finished_req_ids.add(req.request_id)
        self.requests.pop(req.request_id, None)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.num_unfinished > 0

    # ---- the step decision ------------------------------------------------------------
    @property
    def long_prefill_threshold(self) -> int:
        """Prefill chunks above this are 'long': capped per step so short requests get budget too."""
        t = self.config.long_prefill_token_threshold
        if t is not None:
            return t
        if not self.config.enable_chunked_prefill:
            return 0
        return max(self.cache_config.block_size, int(self.max_model_len * 0.04))

    def _pick_victim(self) -> Request | None:
        """The running request to preempt (None: every one has a step in flight)."""
        candidates = [r for r in self.running if r.request_id not in self.in_flight]
        if not candidates:
            return None
        if self.policy == "priority":
            return max(candidates, key=Request.sort_key)
        return candidates[-1]

    def _preempt(self, victim: Request) -> None:
        """Recompute later: free the blocks, keep the tokens, back to the waiting queue."""
        self.running.remove(victim)
        self.kv.free(victim)
        if self.encoder_cache is not None:
            self.encoder_cache.release_all(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.spec_token_ids = []  # it re-prefills; drafts come again after its next sample
        victim.jumped_token_ids = []  # the runner gets every token again when it resumes
        victim.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.prepend(victim)

    def schedule(self) -> SchedulerOutput:
        step = _Step(self)
        # 1) Running requests first, in order; preempt when blocks run out.
        idx = 0
        while idx < len(self.running) and step.budget > 0:
            req = self.running[idx]
            if req.request_id in self.in_flight:  # its previous step is still in the pipeline
                idx += 1
                continue
            num_new = step.chunk(req, req.num_tokens - req.num_computed_tokens, len(req.spec_token_ids))
            if num_new <= 0:
                idx += 1
                continue
            blocks = self.kv.allocate_slots(req, num_new)
            while blocks is None:
                victim = self._pick_victim()
                assert victim is not None  # req itself is not in flight
                if self.running.index(victim) < idx:
                    idx -= 1
                step.preempt(victim)
                if victim is req:
                    break
                blocks = self.kv.allocate_slots(req, num_new)
            if blocks is None:  # req preempted itself: nothing after it can run either
                break
            step.schedule_running(req, num_new, blocks)
            idx += 1

        # 2) Admit waiting requests (never in a step that preempted for lack of blocks).
        self._admit_waiting(step)

        # 3) Leftover budget goes back to capped long prefills, so a lone long prompt is not slowed,
        # then to the long prompts that found no long-prefill slot: the cap only reorders work,
        # it never leaves budget unused (64 prompts of 128 tokens still prefill 16 to a step).
        step.top_up_long_prefills()
        if step.passed_over and step.budget > 0:
            step.threshold = 0
            self._fill_running(step)
            self._admit_waiting(step)
        return step.finish()

    def _admit_waiting(self, step: _Step) -> None:
        """Admit waiting requests in queue order (long prompts without a long-prefill slot wait)."""
        skipped: list[Request] = []
        loras = {r.lora_int_id for r in self.running if r.lora_int_id} if self.max_loras else set()
        while (not step.preempted and len(self.waiting) and step.budget > 0
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting.peek()
            if req.status == RequestStatus.WAITING_FOR_FSM and not self._grammar_ready(req):
                skipped.append(self.waiting.pop())  # its grammar is still compiling (or failed): the others go
                continue
            if req.lora_int_id and req.lora_int_id not in loras and len(loras) >= self.max_loras:
                skipped.append(self.waiting.pop())  # no adapter slot this step: waits, later ones may go
                continue
            computed_blocks, num_computed = self.kv.get_computed_blocks(req)
            remaining = req.num_tokens - num_computed
            if not self.config.enable_chunked_prefill and remaining > step.budget:
                break
            num_new = step.chunk(req, remaining)
            if num_new <= 0:  # a long prompt waits for a long-prefill slot; later ones may go
                skipped.append(self.waiting.pop())
                continue
            blocks = self.kv.allocate_slots(req, num_new, computed_blocks, num_computed)
            # Priority: a more urgent arrival may push out less urgent running requests.
            while blocks is None and self.policy == "priority" and (victim := self._pick_victim()) is not None \
                    and victim.sort_key() > req.sort_key():
                step.preempt(victim, admitting=True)
                computed_blocks, num_computed = self.kv.get_computed_blocks(req)
                num_new = step.chunk(req, req.num_tokens - num_computed, recount=False)
                blocks = self.kv.allocate_slots(req, num_new, computed_blocks, num_computed)
            if blocks is None:
                step.release_long(req)
                break
            self.waiting.pop()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_computed
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_computed
            if req.first_scheduled_time is None:
                req.first_scheduled_time = step.now
            self.running.append(req)
            if req.lora_int_id:
                loras.add(req.lora_int_id)
            step.schedule_new(req, num_new)
        if self.policy == "fcfs":
            for req in reversed(skipped):  # back at the front, in their order
                self.waiting.prepend(req)
        else:
            for req in skipped:
                self.waiting.add(req)

    def _grammar_ready(self, req: Request) -> bool:
        g = req.structured_output
        if g.poll():
            req.status = RequestStatus.WAITING
            return True
        if g.error is not None:
            self.grammar_errors[req.request_id] = g.error
        return False

    def _fill_running(self, step: _Step) -> None:
        """Give leftover budget to running prefills the long-prefill cap passed over (no preemption)."""
        for req in self.running:
            if step.budget <= 0:
                break
            if req.request_id in step.out.num_scheduled_tokens or req.request_id in self.in_flight:
                continue
            num_new = step.chunk(req, req.num_tokens - req.num_computed_tokens)
            if num_new <= 0:
                continue
            blocks = self.kv.allocate_slots(req, num_new)
            if blocks is not None:
                step.schedule_running(req, num_new, blocks)

    # ---- after the forward pass -------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, list[int]],
                           failed: dict[str, str] | None = None, pooled: Any = (),
                           spec_token_ids: dict[str, list[int]] | None = None) -> list[Request]:
        """Append each request's sampled token, apply token-level stop rules; requests that failed in the
        step (``failed``: id -> reason) finish with FINISHED_ERROR and free their blocks. Returns the
        requests that got a token or failed. Pooling requests in ``pooled`` (ids) finished their prompt:
        they finish (stopped) with their pooled output, no token appended. ``spec_token_ids``: the drafts
        proposed for each request's next step; a request's list of sampled tokens is cut at its stop."""
        updated: list[Request] = []
        stopped: list[Request] = []
        self.in_flight.difference_update(out.num_scheduled_tokens)
        for rid in [*(failed or ()), *self.grammar_errors]:
            req = self.requests.get(rid)
            if req is None or req.status.finished:
                continue
            req.status = RequestStatus.FINISHED_ERROR
            updated.append(req)
            stopped.append(req)
        for rid in pooled:
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING:
                continue
            req.status = RequestStatus.FINISHED_STOPPED
            updated.append(req)
            stopped.append(req)
        for rid, tokens in sampled.items():
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING or not tokens:
                continue
            drafts = out.scheduled_spec_decode_tokens.get(rid)
            if drafts:  # tokens: the accepted drafts and one more; rejected positions get computed again
                req.num_computed_tokens -= len(drafts) + 1 - len(tokens)
                if self.spec_stats is not None:
                    self.spec_stats.observe(len(drafts), len(tokens) - 1)
            for kept, tok in enumerate(tokens, start=1):
                req.append_output_token_ids(tok)
                if req.structured_output is not None and not req.structured_output.accept(tok):
                    req.status = RequestStatus.FINISHED_ERROR
                    self.grammar_errors[rid] = f"structured_outputs: token {tok} is not allowed by the grammar"
                elif not self._check_stop(req, tok) and req.structured_output is not None \
                        and req.structured_output.is_terminated():
                    req.status = RequestStatus.FINISHED_STOPPED  # the grammar is complete: nothing may follow
                if req.status.finished:
                    del tokens[kept:]  # what follows a stop is never output (as without speculation)
                    break
            if not req.status.finished and can_jump(req):
                self._jump_forward(req, tokens)
            updated.append(req)
            if req.status.finished:
                stopped.append(req)
            elif spec_token_ids is not None:
                self._set_drafts(req, spec_token_ids.get(rid))
        for req in stopped:
            if req in self.running:
                self.running.remove(req)
            else:  # failed while waiting (preempted in the same step)
                self.waiting.remove(req)
            self._free(req)
        return updated

    def _jump_forward(self, req: Request, tokens: list[int]) -> None:
        """Append the tokens the request's grammar forces from here (structured_output/jump_forward.py) to
        the request and to ``tokens`` (the step's output), within max_tokens and max_model_len, applying
        the stop rules to each; the runner computes them with the request's next schedule."""
        g = req.structured_output
        while True:
            room = min(req.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens)
            tok = next_forced_token(req, room)
            if tok is None:
                return
            req.append_output_token_ids(tok)
            req.jumped_token_ids.append(tok)
            tokens.append(tok)
            self.num_jump_forward_tokens += 1
            if not g.accept(tok):  # the backend's mask allowed only this token: a backend fault
                req.status = RequestStatus.FINISHED_ERROR
                self.grammar_errors[req.request_id] = f"structured_outputs: forced token {tok} was refused"
                return
            if self._check_stop(req, tok):
                return
            if g.is_terminated():
                req.status = RequestStatus.FINISHED_STOPPED
                return

    def _set_drafts(self, req: Request, drafts: list[int] | None) -> None:
        """Keep the drafts that cannot overshoot: k drafts yield up to k + 1 tokens, within max_tokens and
        max_model_len. Structured-output requests are not speculated (their grammar mask is per position)."""
        if not drafts or req.structured_output is not None:
            req.spec_token_ids = []
            return
        room = min(req.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens) - 1
        req.spec_token_ids = drafts[:max(room, 0)]

    def _check_stop(self, req: Request, tok: int) -> bool:
        params = req.sampling_params
        n_out = req.num_output_tokens
        if n_out >= params.min_tokens:
            if not params.ignore_eos and tok == req.eos_token_id:
                req.status = RequestStatus.FINISHED_STOPPED
                return True
            if tok in params.stop_token_ids:  # type: ignore[operator]
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = tok
                return True
        if n_out >= req.max_tokens or req.num_tokens >= self.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def stats(self, step_times: StepTimes | None = None) -> SchedulerStats:
        """The numbers now, as the one stats record (``step_times``: the core's, copied in)."""
        pcs = self.kv.prefix_cache_stats
        return SchedulerStats(num_running=len(self.running), num_waiting=len(self.waiting),
                              kv_cache_usage=self.kv.usage, num_free_blocks=self.kv.get_num_free_blocks(),
                              num_total_blocks=self.kv.num_usable_blocks,
                              num_preemptions_total=self.num_preemptions_total,
                              prefix_cache_queries=pcs.queries, prefix_cache_hits=pcs.hits,
                              num_jump_forward_tokens=self.num_jump_forward_tokens,
                              spec_decoding=self.spec_stats.copy() if self.spec_stats is not None else None,
                              mm_cache=replace(self.encoder_cache.stats) if self.encoder_cache is not None else None,
                              step_times=step_times.copy() if step_times is not None else StepTimes())


class _Step:
    """The decisions of one schedule() call, kept together so a preemption can undo them."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.out = SchedulerOutput()
        self.budget = sched.config.max_num_batched_tokens
        self.now = time.monotonic()
        self.threshold = sched.long_prefill_threshold
        self.max_long = max(1, sched.config.max_num_partial_prefills)
        self.long: list[Request] = []  # long prefills capped this step
        self.passed_over = False  # a long prefill got nothing for want of a slot
        self.preempted: list[Request] = []
        self.running: list[Request] = []
        self.new: list[Request] = []
        self.new_block_ids: dict[str, list[list[int]]] = {}  # per request, per cache group
        self.encoder = sched.encoder_cache.step() if sched.encoder_cache is not None else None

    def chunk(self, req: Request, remaining: int, num_drafts: int = 0, recount: bool = True) -> int:
        """Tokens to give ``req`` now: its remaining tokens (and drafts) within the budget, long prefills
        capped (drafts never make a decode a long prefill)."""
        n = min(remaining + num_drafts, self.budget)
        if self.threshold and remaining > self.threshold:
            if recount:
                if len(self.long) >= self.max_long:
                    self.passed_over = True
                    return 0
                self.long.append(req)
            n = min(n, self.threshold)
        if self.encoder is not None and req.mm_features and n > 0:
            n = self.encoder.plan(req, req.num_tokens - remaining, n, self.sched.config.enable_chunked_prefill)
            if n <= 0:
                self.release_long(req)
        return n

    def release_long(self, req: Request) -> None:
        if req in self.long:
            self.long.remove(req)

    def schedule_running(self, req: Request, n: int, blocks: list[list[int]]) -> None:
        num_drafts = n - (req.num_tokens - req.num_computed_tokens)  # the budget may cut the drafts short
        if num_drafts > 0:
            self.out.scheduled_spec_decode_tokens[req.request_id] = req.spec_token_ids[:num_drafts]
        self.running.append(req)
        self.new_block_ids[req.request_id] = blocks
        self.out.num_scheduled_tokens[req.request_id] = n
        self.budget -= n
        if self.encoder is not None:
            self.encoder.commit(req, n)

    def schedule_new(self, req: Request, n: int) -> None:
        self.new.append(req)
        self.out.num_scheduled_tokens[req.request_id] = n
        self.budget -= n
        if self.encoder is not None:
            self.encoder.commit(req, n)

    def preempt(self, victim: Request, admitting: bool = False) -> None:
        rid = victim.request_id
        if rid in self.out.num_scheduled_tokens:  # undo its place in this step
            self.budget += self.out.num_scheduled_tokens.pop(rid)
            self.out.scheduled_spec_decode_tokens.pop(rid, None)
            self.new_block_ids.pop(rid, None)
            for lst in (self.running, self.new):
                if victim in lst:
                    lst.remove(victim)
        self.release_long(victim)
        self.sched._preempt(victim)
        if not admitting:
            self.preempted.append(victim)
        else:
            self.out.preempted_req_ids.add(rid)

    def top_up_long_prefills(self) -> None:
        kv = self.sched.kv
        for req in list(self.long):
            if self.budget <= 0:
                break
            rid = req.request_id
            have = self.out.num_scheduled_tokens.get(rid)
            if have is None:
                continue
            extra = min(req.num_tokens - req.num_computed_tokens - have, self.budget)
            if self.encoder is not None and req.mm_features and extra > 0:
                extra = self.encoder.plan(req, req.num_computed_tokens + have, extra, True)
            if extra <= 0:
                continue
            blocks = kv.allocate_slots(req, have + extra)
            if blocks is None:
                continue
            if self.encoder is not None:
                self.encoder.commit(req, extra)
            if rid in self.new_block_ids:
                for have_ids, ids in zip(self.new_block_ids[rid], blocks):
                    have_ids.extend(ids)
            self.out.num_scheduled_tokens[rid] = have + extra
            self.budget -= extra

    def finish(self) -> SchedulerOutput:
        sched, out = self.sched, self.out
        for req in self.new:
            req.jumped_token_ids = []  # in token_ids below
            out.scheduled_new_reqs.append(NewRequestData(
                req_id=req.request_id, token_ids=list(req.all_token_ids), num_prompt_tokens=req.num_prompt_tokens,
                sampling_params=req.sampling_params, block_ids=sched.kv.get_block_ids(req),
                num_computed_tokens=req.num_computed_tokens, eos_token_id=req.eos_token_id,
                encoder_inputs=req.encoder_inputs, num_encoder_tokens=req.num_encoder_tokens,
                pooling_params=req.pooling_params, lora_request=req.lora_request, mm_features=req.mm_features))
        for req in self.running:
            nc = req.num_computed_tokens
            out.scheduled_cached_reqs.append(CachedRequestData(
                req_id=req.request_id, new_block_ids=self.new_block_ids[req.request_id],
                num_computed_tokens=nc, new_token_ids=req.jumped_token_ids,
                token_ids=(list(req.all_token_ids[nc:nc + out.num_scheduled_tokens[req.request_id]])
                           if sched.pipeline_parallel else None)))
            req.jumped_token_ids = []
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        if self.encoder is not None:
            self.encoder.finish(out)
        out.preempted_req_ids |= {r.request_id for r in self.preempted}
        # A request preempted and re-admitted in the same step is simply new to the runner.
        out.preempted_req_ids -= {r.request_id for r in self.new}
        out.finished_req_ids = sched.finished_req_ids
        sched.finished_req_ids = set()
        # The tokens are as good as computed once scheduled (the runner computes them in order).
        for rid, n in out.num_scheduled_tokens.items():
            sched.requests[rid].num_computed_tokens += n
        if sched.pipeline_parallel:
            sched.in_flight.update(out.num_scheduled_tokens)
        return out

