"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API on the chat path.

The request becomes a chat completions request (protocol.to_chat) answered by the server's own
ChatServer; its chat.completion (or its chunks, streamed) becomes a Message (or Anthropic's event
sequence: message_start, ping, content_block_start / _delta / _stop per block, message_delta,
message_stop). Reasoning (--reasoning-parser) comes out as ``thinking`` blocks, tool calls as
``tool_use`` blocks (their arguments streamed as ``input_json_delta``). Every error leaves in
Anthropic's shape (``{"type": "error", "error": {"type", "message"}}``; openai.error_handlers picks it
by path), streamed ones as an ``error`` event.
"""
from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request
from starlette.responses import Response

from vllite_core.entrypoints.anthropic.protocol import (
    CountTokensRequest,
    MessagesRequest,
    log_ignored,
    to_chat,
)
from vllite_core.entrypoints.openai.errors import APIError
from vllite_core.entrypoints.openai.routes.generate import generation_servers
from vllite_core.entrypoints.openai.serving_chat import engine_chat_prompt
from vllite_core.entrypoints.openai.serving_common import SSE_HEADERS, server_state
from vllite_core.entrypoints.openai.structured import plan_tools

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


def _stop(finish: str | None, stop_reason: Any, req: MessagesRequest) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence): a matched stop string is Anthropic's ``stop_sequence``."""
    if finish == "stop" and isinstance(stop_reason, str) and stop_reason in (req.stop_sequences or []):
        return "stop_sequence", stop_reason
    return STOP_REASONS.get(finish or "stop", "end_turn"), None


def _tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        value = None
    return value if isinstance(value, dict) else {"arguments": arguments}


def message_of(chat: dict[str, Any], req: MessagesRequest, mid: str) -> dict[str, Any]:
    """A chat.completion as an Anthropic Message."""
    choice = chat["choices"][0]
    msg = choice["message"]
    content: list[dict[str, Any]] = []
    if msg.get("reasoning"):
        content.append({"type": "thinking", "thinking": msg["reasoning"], "signature": ""})
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for call in msg.get("tool_calls") or []:
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": _tool_input(call["function"]["arguments"])})
    stop_reason, stop_sequence = _stop(choice["finish_reason"], choice.get("stop_reason"), req)
    return {"id": mid, "type": "message", "role": "assistant", "model": req.model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": chat["usage"]["prompt_tokens"],
                      "output_tokens": chat["usage"]["completion_tokens"]}}


def event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False)}\n\n"


class _Blocks:
    """Chat deltas -> content blocks: one open at a time, each started, filled and stopped."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # "thinking" | "text" | "tool:<chat index>"

    def start(self, key: str, block: dict[str, Any]) -> list[str]:
        out = self.stop()
        self.index += 1
        self.open = key
        return out + [event("content_block_start", {"index": self.index, "content_block": block})]

    def stop(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"index": self.index})]

    def delta(self, key: str, block: dict[str, Any], delta: dict[str, Any]) -> list[str]:
        out = self.start(key, block) if self.open != key else []
        return out + [event("content_block_delta", {"index": self.index, "delta": delta})]


async def anthropic_events(chunks: AsyncIterator[Any], req: MessagesRequest, mid: str) -> AsyncIterator[str]:
    """The chat stream's SSE chunks (``data: {...}``) as Anthropic's event sequence."""
    blocks = _Blocks()
    started = False
    output_tokens = 0
    finish, stop_reason = None, None
    async for raw in chunks:
        text = raw.decode() if isinstance(raw, bytes) else raw
        for line in text.splitlines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:  # after the headers, an error is an event
                kind = "api_error" if chunk["error"].get("type") == "server_error" else "invalid_request_error"
                yield event("error", {"error": {"type": kind, "message": chunk["error"].get("message", "")}})
                return
            use = chunk.get("usage") or {}
            output_tokens = use.get("completion_tokens", output_tokens)
            if not started:
                started = True
                yield event("message_start", {"message": {
                    "id": mid, "type": "message", "role": "assistant", "model": req.model, "content": [],
                    "stop_reason": None, "stop_sequence": None,
                    "usage": {"input_tokens": use.get("prompt_tokens", 0), "output_tokens": 0}}})
                yield event("ping", {})
            for choice in chunk.get("choices") or []:
                d = choice.get("delta") or {}
                out: list[str] = []
                if d.get("reasoning"):
                    out += blocks.delta("thinking", {"type": "thinking", "thinking": "", "signature": ""},
                                        {"type": "thinking_delta", "thinking": d["reasoning"]})
                if d.get("content"):
                    out += blocks.delta("text", {"type": "text", "text": ""},
                                        {"type": "text_delta", "text": d["content"]})
                for call in d.get("tool_calls") or []:
                    key = f"tool:{call.get('index', 0)}"
                    fn = call.get("function") or {}
                    if blocks.open != key:
                        out += blocks.start(key, {"type": "tool_use", "id": call.get("id"), "name": fn.get("name"),
                                                  "input": {}})
                    if fn.get("arguments"):
                        out += blocks.delta(key, {}, {"type": "input_json_delta", "partial_json": fn["arguments"]})
                for e in out:
                    yield e
                if choice.get("finish_reason") is not None:
                    finish, stop_reason = choice["finish_reason"], choice.get("stop_reason")
    for e in blocks.stop():
        yield e
    reason, sequence = _stop(finish, stop_reason, req)
    yield event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                  "usage": {"output_tokens": output_tokens}})
    yield event("message_stop", {})


router = APIRouter()


@router.post("/v1/messages")
async def create_message(request: Request) -> Response:
    state = server_state(request)
    state.admit(request)
    req = await state.read_body(request, MessagesRequest)
    if req.max_tokens is None:
        raise APIError(400, "max_tokens: Field required", "max_tokens")
    log_ignored(req)
    mid = f"msg_{uuid.uuid4().hex}"
    resp = await generation_servers(request).chat.create(to_chat(req, stream=req.stream), request)
    if isinstance(resp, StreamingResponse):
        return StreamingResponse(anthropic_events(resp.body_iterator, req, mid),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    return JSONResponse(message_of(json.loads(resp.body), req, mid))


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> Response:
    state = server_state(request)
    req = await state.read_body(request, CountTokensRequest)
    state.check_model(req.model)
    creq = to_chat(req)
    plan = plan_tools(creq.tools, creq.tool_choice, creq.parallel_tool_calls)
    # the prompt /v1/messages would send: rendered as chat renders it, images expanded by the model's processor
    _, ids = await engine_chat_prompt(state, creq, plan.template_tools)
    return JSONResponse({"input_tokens": len(ids)})
