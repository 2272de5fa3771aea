"""What both generation endpoints share: server state, body parsing with a size limit,
model-name checks, running requests (one stream per prompt) until the client leaves,
server-sent events and usage."""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from vllite_core.engine.async_llm import AsyncLLM
from vllite_core.engine.llm_engine import PromptType
from vllite_core.engine.request_stream import RequestStream
from vllite_core.entrypoints.openai.admission import DEFAULT_MAX_LOGPROB_ENTRIES, LogprobBudget, estimate_cost
from vllite_core.entrypoints.openai.body_parser import BodyParser, BodyParserDied
from vllite_core.entrypoints.openai.errors import APIError, bad_request
from vllite_core.entrypoints.openai.request_logger import RequestLogger
from vllite_core.entrypoints.openai.template_sandbox import TemplateSandbox
from vllite_core.entrypoints.openai.tracing import RequestTracer
from vllite_core.outputs import RequestOutput
from vllite_core.sampling_params import SamplingParams

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

DEFAULT_MAX_BODY_BYTES = 4 << 20
DEFAULT_BODY_READ_TIMEOUT_S = 30.0
DEFAULT_RESTART_QUEUE_SIZE = 64  # requests that may wait for a restarting engine core
DEFAULT_RESTART_QUEUE_TIMEOUT_S = 60.0
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


@dataclass
class ServerState:
    engine: AsyncLLM
    model_names: list[str]
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    api_key: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: Any = None  # ServerMetrics, set by the app
    max_waiting_requests: int | None = None  # more accepted-but-not-started requests than this: 503
    request_timeout: float | None = None  # seconds from arrival; then the request is aborted
    body_read_timeout: float | None = DEFAULT_BODY_READ_TIMEOUT_S
    stopping: asyncio.Event = field(default_factory=asyncio.Event)  # set: in-flight requests end now
    chat_template: str | None = None  # --chat-template (a request's own chat_template wins)
    reasoning_parser: Any = None  # --reasoning-parser: a vllite_core.reasoning parser, or None
    # Tool calling: tool_choice "auto" needs --enable-auto-tool-choice and a parser (--tool-call-parser).
    enable_auto_tool_choice: bool = False
    tool_parser: Any = None  # a vllite_core.tool_parsers.ToolParser class
    loras: Any = None  # serving_lora.ServedLoRAs: adapters served by name (--enable-lora)
    # Every chat template renders in this sandbox; a request's own only with --trust-request-chat-template.
    templates: TemplateSandbox = field(default_factory=TemplateSandbox)
    trust_request_chat_template: bool = False
    request_logger: RequestLogger | None = None  # --enable-log-requests
    tracer: RequestTracer | None = None  # --otlp-traces-endpoint
    server_load: int = 0  # HTTP requests in flight on the load-aware routes (--enable-server-load-tracking: /load)
    # Logprob entries the requests in flight may hold (--max-logprob-entries-in-flight; admission.py).
    logprob_budget: LogprobBudget | None = field(default_factory=lambda: LogprobBudget(DEFAULT_MAX_LOGPROB_ENTRIES))
    # While a dead engine core restarts, this many new requests wait for it, each at most this long
    # (--engine-restart-queue-size / --engine-restart-queue-timeout); then 503 + Retry-After.
    restart_queue_size: int = DEFAULT_RESTART_QUEUE_SIZE
    restart_queue_timeout: float = DEFAULT_RESTART_QUEUE_TIMEOUT_S
    restart_waiters: int = 0
    body_parser: BodyParser = field(default_factory=BodyParser)  # large bodies validated off the event loop

    async def read_body(self, request: Request, model: type[M]) -> M:
        """The request's JSON body as ``model``, under this server's size and time limits (``read_body``'s
        checks); a large body is validated in a helper process (body_parser.py), not on the event loop."""
        body = await read_bytes(request, self.max_body_bytes, self.body_read_timeout)
        try:
            parsed, err = await self.body_parser.parse(body, model)
        except BodyParserDied:
            raise APIError(503, "the request body parser stopped: retry", code="body_parser_failed",
                           headers={"Retry-After": "1"}) from None
        if err is not None:
            raise first_error(err)
        assert parsed is not None
        return parsed

    async def read_raw(self, request: Request) -> bytes:
        """The request's JSON body unparsed, under the same checks and limits."""
        return await read_bytes(request, self.max_body_bytes, self.body_read_timeout)

    def num_waiting(self) -> int:
        """Requests accepted but without a first token yet (queued in the scheduler or in prefill)."""
        return sum(1 for s in list(self.engine._streams.values()) if s.first_token is None)

    def admit(self, request: Request) -> None:
        """Before a generation request is read: 503 while shutting down or over the waiting limit;
        then its time limits apply to whatever it streams (see ``merged``), and the engine requests it
        adds are logged and traced (``add_streams``) with its headers."""
        if self.stopping.is_set():
            raise APIError(503, "the server is shutting down", code="server_shutting_down",
                           headers={"Retry-After": "5", "Connection": "close"})
        self.check_capacity()
        deadline = None if self.request_timeout is None else time.monotonic() + self.request_timeout
        _LIMITS.set(_Limits(deadline, self.request_timeout, self.stopping, self, request.headers))

    async def within_timeout(self, work: Awaitable[T]) -> T:
        """``work`` (request preparation: a template render, tokenizing, a LoRA load) under the
        request's --request-timeout, counted from its arrival: 504 past it."""
        limits = _LIMITS.get()
        if limits is None or limits.deadline is None:
            return await work
        left = limits.deadline - time.monotonic()
        try:
            return await asyncio.wait_for(work, max(left, 0.0))
        except asyncio.TimeoutError:
            raise APIError(504, f"the request ran past the server's {limits.timeout:g} s request timeout while "
                           "being prepared and was aborted", code="request_timeout") from None

    async def wait_for_restart(self) -> None:
        """While every engine core restarts (within its restart budget, so it is expected back), wait
        for it instead of failing (while one data-parallel core restarts, the live ones take requests):
        at most ``restart_queue_size`` requests wait, each at most
        ``restart_queue_timeout`` s (and its --request-timeout); otherwise 503 with Retry-After."""
        engine = self.engine
        if engine.all_cores_restarting is None or engine.dead is not None:
            return
        if self.restart_waiters >= self.restart_queue_size:
            raise APIError(503, f"the engine core is restarting after it died and {self.restart_queue_size} requests "
                           f"already wait for it: retry later ({engine.all_cores_restarting})",
                           code="engine_restarting", headers={"Retry-After": "5"})
        self.restart_waiters += 1
        try:
            deadline = time.monotonic() + self.restart_queue_timeout
            while engine.all_cores_restarting is not None and engine.dead is None:
                if time.monotonic() >= deadline:
                    raise APIError(503, f"the engine core did not finish restarting within "
                                   f"{self.restart_queue_timeout:g} s: retry later ({engine.all_cores_restarting})",
                                   code="engine_restarting", headers={"Retry-After": "5"})
                await asyncio.sleep(0.05)
        finally:
            self.restart_waiters -= 1

    def check_capacity(self) -> None:
        if self.max_waiting_requests is not None and self.num_waiting() >= self.max_waiting_requests:
            raise APIError(503, f"the server is overloaded ({self.max_waiting_requests} requests are already "
                           "waiting): retry later", code="server_overloaded", headers={"Retry-After": "1"})

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names and self.lora_request(name) is None:
            served = self.model_names + (list(self.loras.requests) if self.loras is not None else [])
            raise APIError(404, f"The model `{name}` does not exist. This server serves: "
                           f"{', '.join(served)}", "model", "model_not_found")

    def lora_request(self, name: str | None) -> Any:
        """The LoRARequest a request's ``model`` names (None: the base model)."""
        return self.loras.get(name) if self.loras is not None else None

    def response_model(self, name: str | None) -> str:
        """The ``model`` a response names: the adapter asked for, else the base model."""
        return name if self.lora_request(name) is not None else self.model_name


def server_state(request: Request) -> ServerState:
    """The state every route reads, put on the app by ``build_app``."""
    return request.app.state.vllite


@dataclass
class _Limits:
    deadline: float | None  # time.monotonic()
    timeout: float | None
    stop: asyncio.Event
    state: ServerState
    headers: Mapping[str, str]  # the HTTP request's (trace context)


# Set by ServerState.admit in the request's handler; read where its outputs are awaited (merged),
# so both generation endpoints get the limits without passing them through.
_LIMITS: contextvars.ContextVar[_Limits | None] = contextvars.ContextVar("vllite_request_limits", default=None)


def _raise_if_ended(limits: _Limits | None) -> None:
    """The APIError that ends the request now, if any: the server stopped waiting for in-flight
    requests (503) or its deadline passed (504)."""
    if limits is None:
        return
    if limits.stop.is_set():
        raise APIError(503, "the server is shutting down: request ended", code="server_shutting_down")
    if limits.deadline is not None and time.monotonic() >= limits.deadline:
        raise APIError(504, f"the request ran past the server's {limits.timeout:g} s request timeout and was "
                       "aborted", code="request_timeout")


async def _until_ended(limits: _Limits | None) -> None:
    """Returns when ``_raise_if_ended`` would raise (never without limits): one task per request."""
    if limits is None:
        await asyncio.get_running_loop().create_future()
        return
    timeout = None if limits.deadline is None else max(0.0, limits.deadline - time.monotonic())
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(limits.stop.wait(), timeout)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _param(loc: tuple) -> str | None:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.lower() in _TYPE_TAGS or "[" in part or "-" in part:
            continue  # which branch of a union failed: not a field
        else:
            out += ("." if out else "") + part
    return out or None


def is_json_content_type(value: str) -> bool:
    media = value.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def read_body(request: Request, model: type[M], limit: int, timeout: float | None = None) -> M:
    """The JSON body as ``model`` (``read_bytes``'s checks, then 400 for malformed JSON, wrong types
    and unknown fields)."""
    body = await read_bytes(request, limit, timeout)
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e) from None


def validation_error(e: ValidationError) -> APIError:
    """A body's first validation error as a 400 naming the field."""
    return first_error(dict(e.errors(include_url=False)[0]))


def first_error(err: Mapping[str, Any]) -> APIError:
    """One pydantic error (type, loc, msg) as a 400 naming the field."""
    if err["type"] == "json_invalid":
        return bad_request(f"malformed JSON body: {err['msg']}", None, "invalid_json")
    param = _param(tuple(err["loc"]))
    if err["type"] == "extra_forbidden":
        return bad_request(f"unrecognized request argument: {param}", param, "unknown_parameter")
    where = f"{param}: " if param else ""
    return bad_request(f"{where}{err['msg']}", param)


async def read_bytes(request: Request, limit: int, timeout: float | None = None) -> bytes:
    """The body: 413 over ``limit`` bytes (checked before reading when the client says the length),
    415 unless the Content-Type is JSON (a web page's cross-origin "simple" request cannot send one),
    408 when the body takes over ``timeout`` seconds to arrive."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes is over the {limit}-byte limit", code="body_too_large")
    if not is_json_content_type(request.headers.get("content-type", "")):
        raise APIError(415, "send the body as JSON with 'Content-Type: application/json'",
                       code="unsupported_media_type")

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"request body is over the {limit}-byte limit", code="body_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(read(), timeout)
    except ClientDisconnect:
        raise APIError(400, "client disconnected while sending the body") from None
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s", code="body_read_timeout",
                       headers={"Connection": "close"}) from None


def with_cache_salt(prompt: PromptType, salt: str | None) -> PromptType:
    """The prompt as a dict carrying the request's ``cache_salt`` (the engine checks it is a
    non-empty string and refuses anything else, naming the field)."""
    if salt is None:
        return prompt
    return {"prompt": prompt, "cache_salt": salt} if isinstance(prompt, str) else {**prompt, "cache_salt": salt}


async def add_streams(engine: AsyncLLM, prompts: list[PromptType], params: SamplingParams, base_id: str,
                      priority: int, cache_salt: str | None = None, lora_request: Any = None,
                      requested_max_tokens: int | None = None,
                      prompt_logprobs_field: str = "prompt_logprobs") -> list[RequestStream]:
    """One engine request per prompt (each carrying ``cache_salt``); all or nothing. The prompts are
    tokenized and validated on the engine's prep thread (AsyncLLM.run_prep), not on the event loop.
    Under ServerState.admit the waiting limit is checked again after that, where the requests are
    queued (no await in between, so concurrent requests cannot all slip under it). While a dead engine
    core restarts, the request first waits for it (ServerState.wait_for_restart). ``requested_max_tokens``
    (the request's own) past the context left after a prompt is a 400, as in vLLM. The logprob entries
    the requests will produce are charged to the server's budget (admission.py; 400 naming
    ``prompt_logprobs_field`` or ``logprobs`` when they can never fit, 503 when not now)."""
    limits = _LIMITS.get()
    if limits is not None:
        await limits.state.within_timeout(limits.state.wait_for_restart())
        limits.state.check_capacity()
    rids = [base_id if len(prompts) == 1 else f"{base_id}-{i}" for i in range(len(prompts))]
    for rid in rids:
        engine.check_new(rid, priority)

    def prepare_all() -> list:
        return [engine.prepare(with_cache_salt(p, cache_salt), params, lora_request) for p in prompts]

    if limits is not None:  # preparation counts toward --request-timeout
        prepared = await limits.state.within_timeout(engine.run_prep(prepare_all))
        limits.state.check_capacity()
    else:
        prepared = await engine.run_prep(prepare_all)
    for (processed, _) in prepared:  # the request's own max_tokens (a model default is capped instead)
        check_max_tokens(engine.max_model_len, len(processed.prompt_token_ids), requested_max_tokens)
    if limits is not None and limits.state.request_logger is not None:
        for rid, (processed, _) in zip(rids, prepared):
            limits.state.request_logger.log_inputs(rid, processed.prompt, processed.prompt_token_ids, params,
                                                   lora_request)
    if limits is not None and limits.state.logprob_budget is not None and isinstance(params, SamplingParams):
        costs = {rid: estimate_cost(len(processed.prompt_token_ids), params, max_tokens)
                 for rid, (processed, max_tokens) in zip(rids, prepared)}
        limits.state.logprob_budget.admit(costs, engine._streams, prompt_logprobs_field)
    streams: list[RequestStream] = []
    try:
        for rid, (processed, max_tokens) in zip(rids, prepared):
            streams.append(engine.add_prepared(rid, processed, params, max_tokens, priority))
    except BaseException:
        for s in streams:
            engine.abort(s.request_id)
        raise
    if limits is not None and limits.state.tracer is not None:  # a span when each one finishes
        model = lora_request.lora_name if lora_request is not None else limits.state.model_name
        for rid in rids:
            limits.state.tracer.track(rid, params, model, limits.headers)
    return streams


def check_max_tokens(max_model_len: int, num_prompt_tokens: int, max_tokens: int | None) -> None:
    """vLLM's refusal (and wording) of a max_tokens the context cannot hold after this prompt."""
    if max_tokens is not None and max_tokens > max_model_len - num_prompt_tokens:
        raise bad_request(f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum "
                          f"context length is {max_model_len} tokens and your request has {num_prompt_tokens} input "
                          f"tokens ({max_tokens} > {max_model_len} - {num_prompt_tokens}).", "max_tokens",
                          "context_length_exceeded")


def merged(engine: AsyncLLM, streams: list[RequestStream], delta: bool) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several streams as they come; leaving early aborts them all.
    Under the request's limits (ServerState.admit, read here, where the handler calls this): past
    its deadline, or when shutdown stops waiting, it raises an APIError and aborts them."""
    return _merged(engine, streams, delta, _LIMITS.get())


async def _merged(engine: AsyncLLM, streams: list[RequestStream], delta: bool, limits: _Limits | None
                  ) -> AsyncIterator[tuple[int, RequestOutput]]:
    try:
        if len(streams) == 1 and limits is None:
            async for out in engine.iterate(streams[0], delta):
                yield 0, out
            return
        # One pending read per stream, taken again only after its output was consumed: while the client is
        # slow, a stream's outputs coalesce in it (each is cumulative) instead of queueing here, and the limits'
        # error is raised as soon as the output being sent has gone, not behind a backlog.
        readers = [engine.iterate(s, delta) for s in streams]
        pending = {i: asyncio.ensure_future(anext(r)) for i, r in enumerate(readers)}
        wake = asyncio.ensure_future(_until_ended(limits))
        try:
            while pending:
                await asyncio.wait([*pending.values(), wake], return_when=asyncio.FIRST_COMPLETED)
                for i in [i for i, f in pending.items() if f.done()]:
                    _raise_if_ended(limits)  # checked before each output: the error comes next, not behind them
                    try:
                        out = pending.pop(i).result()
                    except StopAsyncIteration:
                        continue
                    yield i, out
                    pending[i] = asyncio.ensure_future(anext(readers[i]))
                _raise_if_ended(limits)
        finally:
            for f in [*pending.values(), wake]:
                f.cancel()
    finally:
        for s in streams:
            engine.abort(s.request_id)  # no-op for finished ones


async def final_outputs(engine: AsyncLLM, streams: list[RequestStream]) -> list[RequestOutput]:
    last: dict[int, RequestOutput] = {}
    async for i, out in merged(engine, streams, delta=False):
        last[i] = out
    return [last[i] for i in range(len(streams))]


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run ``work`` unless the client goes away first; then cancel it (which aborts its requests)."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        raise APIError(499, "client disconnected", code="client_closed_request")
    return task.result()


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
