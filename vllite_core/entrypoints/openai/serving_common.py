"""What both generation endpoints share: server state, body parsing with a size limit,
model-name checks, running requests (one stream per prompt) until the client leaves,
server-sent events and usage."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from vllite_core.engine.async_llm import AsyncLLM, RequestStream
from vllite_core.engine.llm_engine import PromptType
from vllite_core.entrypoints.openai.errors import APIError, bad_request
from vllite_core.outputs import RequestOutput
from vllite_core.sampling_params import SamplingParams

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

DEFAULT_MAX_BODY_BYTES = 4 << 20
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


@dataclass
class ServerState:
    engine: AsyncLLM
    model_names: list[str]
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    api_key: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: Any = None  # ServerMetrics, set by the app

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise APIError(404, f"The model `{name}` does not exist. This server serves: "
                           f"{', '.join(self.model_names)}", "model", "model_not_found")


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


async def read_body(request: Request, model: type[M], limit: int) -> M:
    """The JSON body as ``model``: 413 over ``limit`` bytes (checked before reading when the
    client says the length), 400 for malformed JSON, wrong types and unknown fields."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes is over the {limit}-byte limit", code="body_too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"request body is over the {limit}-byte limit", code="body_too_large")
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(400, "client disconnected while sending the body") from None
    body = b"".join(chunks)
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        if err["type"] == "json_invalid":
            raise bad_request(f"malformed JSON body: {err['msg']}", None, "invalid_json") from None
        param = _param(tuple(err["loc"]))
        if err["type"] == "extra_forbidden":
            raise bad_request(f"unrecognized request argument: {param}", param, "unknown_parameter") from None
        where = f"{param}: " if param else ""
        raise bad_request(f"{where}{err['msg']}", param) from None


def with_cache_salt(prompt: PromptType, salt: str | None) -> PromptType:
    """The prompt as a dict carrying the request's ``cache_salt`` (the engine checks it is a
    non-empty string and refuses anything else, naming the field)."""
    if salt is None:
        return prompt
    return {"prompt": prompt, "cache_salt": salt} if isinstance(prompt, str) else {**prompt, "cache_salt": salt}


def add_streams(engine: AsyncLLM, prompts: list[PromptType], params: SamplingParams, base_id: str,
                priority: int, cache_salt: str | None = None) -> list[RequestStream]:
    """One engine request per prompt (each carrying ``cache_salt``); all or nothing."""
    streams: list[RequestStream] = []
    try:
        for i, p in enumerate(prompts):
            rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
            streams.append(engine.add_request(with_cache_salt(p, cache_salt), params, rid, priority))
    except BaseException:
        for s in streams:
            engine.abort(s.request_id)
        raise
    return streams


async def merged(engine: AsyncLLM, streams: list[RequestStream], delta: bool
                 ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several streams as they come; leaving early aborts them all."""
    try:
        if len(streams) == 1:
            async for out in engine.iterate(streams[0], delta):
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, s: RequestStream) -> None:
            try:
                async for out in engine.iterate(s, delta):
                    queue.put_nowait((i, out, None))
            except Exception as e:
                queue.put_nowait((i, None, e))
            queue.put_nowait((i, None, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            left = len(tasks)
            while left:
                i, out, err = await queue.get()
                if err is not None:
                    raise err
                if out is None:
                    left -= 1
                    continue
                yield i, out
        finally:
            for t in tasks:
                t.cancel()
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
