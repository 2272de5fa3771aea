"""One request as AsyncLLM's asyncio side sees it (``RequestStream``: the latest cumulative output, an
event, its timings) and what it reports when it ends (``FinishedRequest``, for /metrics and tracing)."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from vllite_core.engine.delta import DeltaCursor
from vllite_core.outputs import RequestOutput
from vllite_core.sampling_params import SamplingParams


@dataclass
class FinishedRequest:
    """What a finished (or aborted) request reports to observers such as /metrics."""

    request_id: str
    finish_reasons: list[str]
    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_s: float
    ttft_s: float | None
    tpot_s: float | None  # mean time per output token after the first, per completion
    queue_s: float | None
    prefill_s: float | None = None  # first scheduled -> first token
    decode_s: float | None = None  # first token -> finish
    inference_s: float | None = None  # first scheduled -> finish
    inter_token_s: list[float] = field(default_factory=list)  # gaps between steps that brought tokens
    n: int = 1
    max_tokens: int | None = None
    max_generation_tokens: int = 0  # of the longest completion
    engine_index: int = 0  # the data-parallel engine core that served it (vLLM's ``engine`` label)


@dataclass
class RequestStream:
    """One request as seen from asyncio: the latest cumulative output, an event, timings."""

    request_id: str
    params: SamplingParams
    num_prompt_tokens: int
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    num_tokens_seen: int = 0
    inter_token: list[float] = field(default_factory=list)
    finished: bool = False
    latest: RequestOutput | None = None
    error: BaseException | None = None
    _event: asyncio.Event = field(default_factory=asyncio.Event)
    _cursor: DeltaCursor = field(init=False)

    def __post_init__(self) -> None:
        self._cursor = DeltaCursor(self.params.max_stop_str_len)

    def _put(self, out: RequestOutput) -> None:
        self.latest = out
        num_tokens = sum(len(c.token_ids) for c in out.outputs)
        if num_tokens > self.num_tokens_seen:
            now = time.monotonic()
            if self.first_token is None:
                self.first_token = now
            else:
                self.inter_token.append(now - self.last_token)
            self.last_token = now
            self.num_tokens_seen = num_tokens
        if out.finished:
            self.finished = True
        self._event.set()

    def _fail(self, exc: BaseException) -> None:
        self.error = exc
        self.finished = True
        self._event.set()

    async def next_output(self) -> RequestOutput:
        """Wait for news; outputs that arrived meanwhile are coalesced (each one is cumulative)."""
        await self._event.wait()
        self._event.clear()
        if self.error is not None:
            raise self.error
        assert self.latest is not None
        return self.latest

    def view(self, out: RequestOutput, delta: bool) -> RequestOutput | None:
        """The output to hand the caller (see DeltaCursor): text is held back while it could still be
        the start of a stop string; in delta mode only what is new (None when nothing is)."""
        return self._cursor.view(out, delta)

    def report(self, out: RequestOutput | None, aborted: bool) -> FinishedRequest:
        now = time.monotonic()
        comps = out.outputs if out is not None else []
        gen = sum(len(c.token_ids) for c in comps)
        reasons = ["abort"] * max(self.params.n, 1) if aborted else [c.finish_reason or "abort" for c in comps]
        tpot = None
        if self.first_token is not None and comps and not aborted:
            per_child = gen / len(comps)
            if per_child > 1:
                tpot = (now - self.first_token) / (per_child - 1)
        m = out.metrics if out is not None else None
        queue = m.queue_time if m is not None else None
        scheduled = m.first_scheduled_time if m is not None else None
        ttft = self.first_token - self.arrival if self.first_token is not None else None
        rec = FinishedRequest(self.request_id, reasons, self.num_prompt_tokens, gen, now - self.arrival, ttft, tpot,
                              queue, inter_token_s=self.inter_token, n=self.params.n,
                              max_tokens=getattr(self.params, "max_tokens", None),  # PoolingParams have none
                              max_generation_tokens=max((len(c.token_ids) for c in comps), default=0))
        if scheduled is not None:
            rec.inference_s = now - scheduled
            if self.first_token is not None:
                rec.prefill_s = self.first_token - scheduled
        if self.first_token is not None:
            rec.decode_s = now - self.first_token
        return rec
