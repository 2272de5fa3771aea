"""Frontend side of a request: detokenize, apply stop strings, build RequestOutputs.

One RequestOutputState per user request, holding one CompletionState per engine
request. A request with ``n > 1`` fans out into n engine requests (children
share the prompt's KV blocks through the prefix cache) and is reported as one
RequestOutput with n completions. Outputs are built cumulative; ``delta=True``
passes them through the request's DeltaCursor (engine/delta.py), the same code
the async front streams with.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from vllite_core.engine.core import EngineCoreOutput
from vllite_core.engine.delta import DeltaCursor
from vllite_core.engine.detokenizer import IncrementalDetokenizer
from vllite_core.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestMetrics, RequestOutput
from vllite_core.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class CompletionState:
    """One completion (one engine request): its detokenizer, tokens, logprobs, finish."""

    index: int
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None


@dataclass
class RequestOutputState:
    """What one user request's RequestOutput is built from: prompt, params, timings and its
    n completions, keyed by their engine request ids."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: dict[str, CompletionState]
    cursor: DeltaCursor
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    prompt_logprobs: PromptLogprobs | None = None
    pooling_output: Any = None
    kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # the params' output_kind (pooling: cumulative)

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children.values())


def child_request_ids(request_id: str, n: int) -> list[str]:
    return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]


class OutputProcessor:
    def __init__(self, tokenizer: Any, eos_token_id: int | None = None) -> None:
        self.tokenizer = tokenizer
        # the engine's EOS id: a request it ended keeps it in token_ids but not in its text
        self.eos_token_id = eos_token_id if eos_token_id is not None else getattr(tokenizer, "eos_token_id", None)
        self.states: dict[str, RequestOutputState] = {}  # parent id -> state
        self.child_to_parent: dict[str, str] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
            child_ids: list[str], cumulative_deltas: bool = False) -> None:
        """``cumulative_deltas``: an ``output_kind`` of DELTA gets cumulative outputs (its consumer makes the
        deltas)."""
        children = {}
        for i, cid in enumerate(child_ids):
            children[cid] = CompletionState(
                index=i, detok=IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params),
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None)
            self.child_to_parent[cid] = request_id
        kind = getattr(params, "output_kind", RequestOutputKind.CUMULATIVE)
        if cumulative_deltas and kind is RequestOutputKind.DELTA:
            kind = RequestOutputKind.CUMULATIVE
        self.states[request_id] = RequestOutputState(
            request_id, prompt, prompt_token_ids, params, children, DeltaCursor(params.max_stop_str_len), kind=kind)

    def has(self, request_id: str) -> bool:
        return request_id in self.states

    def abort(self, request_id: str) -> list[str]:
        st = self.states.pop(request_id, None)
        if st is None:
            return []
        for cid in st.children:
            self.child_to_parent.pop(cid, None)
        return [cid for cid, c in st.children.items() if c.finish_reason is None]

    def _decode_logprobs(self, ids: list[int], vals: list[float], rank: int) -> dict[int, Logprob]:
        entry: dict[int, Logprob] = {}
        for j, (tid, val) in enumerate(zip(ids, vals)):
            if tid in entry:
                continue
            r = rank if j == 0 else j
            entry[tid] = Logprob(val, r, self.tokenizer.decode([tid]))
        return entry

    def process(self, outputs: list[EngineCoreOutput], delta: bool = False
                ) -> tuple[list[RequestOutput], list[str]]:
        """Apply core outputs. Returns RequestOutputs for updated requests (with ``delta`` or a request's
        ``output_kind`` DELTA, only what is new, and only those with news; FINAL_ONLY: only once finished)
        and the child ids stopped here by a stop string (the caller must finish them in the core)."""
        now = time.monotonic()
        touched: dict[str, RequestOutputState] = {}
        to_stop: list[str] = []
        for out in outputs:
            pid = self.child_to_parent.get(out.request_id)
            if pid is None:
                continue
            st = self.states[pid]
            child = st.children[out.request_id]
            if child.finish_reason is not None:
                continue
            if st.first_scheduled is None:
                st.first_scheduled = out.first_scheduled_time
            if out.new_token_ids and st.first_token is None:
                st.first_token = now
            st.last_token = now
            st.num_cached_tokens = max(st.num_cached_tokens, out.num_cached_tokens)
            st.num_preemptions = max(st.num_preemptions, out.num_preemptions)
            if out.prompt_logprobs is not None and st.prompt_logprobs is None:
                st.prompt_logprobs = [None] + [self._decode_logprobs(lp.token_ids, lp.values, lp.sampled_rank)
                                               for lp in out.prompt_logprobs]
            if out.pooling_output is not None:
                st.pooling_output = out.pooling_output
            # a request ended by its EOS or a stop token id: that token is kept in the ids but not in the text
            # (vLLM's detokenizer skips it), so it shows even with skip_special_tokens=False only when asked; a
            # request ended otherwise (its grammar complete) keeps its last token's text
            params = child.detok.params
            last = out.new_token_ids[-1] if out.new_token_ids else None
            stop_token = (out.finish_reason == "stop" and not params.include_stop_str_in_output
                          and last is not None and (out.stop_reason == last if isinstance(out.stop_reason, int)
                                                    else out.stop_reason is None and last == self.eos_token_id))
            new_ids, stop = self._detokenize(child, out.new_token_ids, stop_token)
            child.token_ids.extend(new_ids)
            if out.new_logprobs and child.logprobs is not None:
                for lp in out.new_logprobs[:len(new_ids)]:
                    child.logprobs.append(self._decode_logprobs(lp.token_ids, lp.values, lp.sampled_rank))
                    child.cumulative_logprob = (child.cumulative_logprob or 0.0) + lp.values[0]
            if stop is not None:
                child.finish_reason, child.stop_reason = "stop", stop
                if out.finish_reason is None:
                    to_stop.append(out.request_id)
            elif out.finish_reason is not None:
                child.finish_reason, child.stop_reason = out.finish_reason, out.stop_reason
                child.error = out.error
            touched[pid] = st
        results = []
        for st in touched.values():
            finished = st.finished
            if st.kind is RequestOutputKind.FINAL_ONLY:  # no output object per step (LLM.generate's requests)
                if finished:
                    results.append(self._make_output(st, copy=False))
            elif delta or st.kind is RequestOutputKind.DELTA:  # the cursor reads the live lists at once: no copy
                view = st.cursor.delta(self._make_output(st, copy=False))
                if view is not None:
                    results.append(view)
            else:
                results.append(self._make_output(st))
            if finished:
                self.states.pop(st.request_id, None)
                for cid in st.children:
                    self.child_to_parent.pop(cid, None)
        return results, to_stop

    @staticmethod
    def _detokenize(child: CompletionState, new_ids: list[int], stop_token: bool) -> tuple[list[int], str | None]:
        """Add a step's tokens; returns the ones kept and the stop string found. Several tokens in a step
        (speculative decoding) are checked one by one, so nothing after a stop string is output.
        ``stop_token``: the last id ended the request (EOS or a stop token id): it is not detokenized."""
        shown = new_ids[:-1] if stop_token and new_ids else new_ids
        if len(shown) <= 1 or not child.detok.params.stop:
            child.detok.add_tokens(shown)
            return new_ids, child.detok.check_stop()
        for j, tid in enumerate(shown):
            child.detok.add_tokens([tid])
            stop = child.detok.check_stop()
            if stop is not None:
                return new_ids[:j + 1], stop
        return new_ids, None

    def _make_output(self, st: RequestOutputState, copy: bool = True) -> RequestOutput:
        """The cumulative output (all text and tokens so far)."""
        comps = [CompletionOutput(index=c.index, text=c.detok.output_text,
                                  token_ids=list(c.token_ids) if copy else c.token_ids,
                                  cumulative_logprob=c.cumulative_logprob, logprobs=c.logprobs,
                                  finish_reason=c.finish_reason, stop_reason=c.stop_reason, error=c.error)
                 for c in st.children.values()]
        finished = st.finished
        m = RequestMetrics(arrival_time=st.arrival, num_prompt_tokens=len(st.prompt_token_ids),
                           num_generation_tokens=sum(len(c.token_ids) for c in st.children.values()),
                           num_cached_tokens=st.num_cached_tokens, num_preemptions=st.num_preemptions,
                           structured_output_backend=_backend_of(st.params))
        if st.first_scheduled is not None:
            m.queue_time = st.first_scheduled - st.arrival
            m.first_scheduled_time = st.first_scheduled
        if st.first_token is not None:
            m.time_to_first_token = st.first_token - st.arrival
            m.decode_time = (st.last_token or st.first_token) - st.first_token
        if finished:
            m.e2e_latency = time.monotonic() - st.arrival
        return RequestOutput(request_id=st.request_id, prompt=st.prompt, prompt_token_ids=st.prompt_token_ids,
                             prompt_logprobs=st.prompt_logprobs, outputs=comps, finished=finished, metrics=m,
                             num_cached_tokens=st.num_cached_tokens, pooling_output=st.pooling_output)


def _backend_of(params: SamplingParams) -> str | None:
    so = params.structured_outputs
    return so._backend if so is not None else None
