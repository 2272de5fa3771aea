"""Anthropic's Messages API request, translated to a chat completions request; its errors' shape.

A Messages request is served by the chat path (as vLLM serves it): the same chat template, tool
parsers and structured output, so its text is what /v1/chat/completions gives for the same
conversation. Here the body is checked (strict: an unknown field is a 400 naming it) and turned
into a ``ChatCompletionRequest``: ``system`` -> a system message, ``tool_use`` blocks -> the
assistant's ``tool_calls``, ``tool_result`` blocks -> ``tool`` messages, images -> ``image_url``
parts (a data URL for base64 sources), ``tools`` / ``tool_choice`` / ``stop_sequences`` /
``output_config.format`` -> their chat equivalents. Block kinds served nowhere here (documents,
server tools' results) are a 400 naming the block.
"""
from __future__ import annotations

import json
import logging
import threading
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from vllite_core.entrypoints.openai.errors import APIError, bad_request
from vllite_core.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, Int

logger = logging.getLogger("vllite.server")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class MessageParam(BaseModel):
    """One turn; its content blocks are checked in ``to_chat`` (so the 400 names the block)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(_Strict):
    """POST /v1/messages (and, without ``max_tokens`` / ``stream``, /v1/messages/count_tokens): the
    fields of the ``anthropic`` package's ``MessageCreateParams``, plus ``temperature`` / ``top_p`` /
    ``top_k`` (Anthropic's sampling fields)."""

    model: str
    messages: list[MessageParam]
    max_tokens: Int | None = None
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    # Accepted, ignored (named once in the log): nothing here acts on them.
    cache_control: dict[str, Any] | None = None
    container: str | dict[str, Any] | None = None
    diagnostics: dict[str, Any] | None = None
    inference_geo: str | None = None
    service_tier: str | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


class CountTokensRequest(MessagesRequest):
    max_tokens: Int | None = Field(default=None, exclude=True)


IGNORED = ("metadata", "cache_control", "container", "diagnostics", "inference_geo", "service_tier", "speed",
           "user_profile_id", "workspace_id")
_logged: set[str] = set()
_lock = threading.Lock()


def log_ignored(req: MessagesRequest) -> None:
    names = [f for f in IGNORED if getattr(req, f) is not None]
    with _lock:
        new = [n for n in names if n not in _logged]
        _logged.update(new)
    if new:
        logger.warning("/v1/messages: ignoring request field(s) %s: nothing on this server acts on them (named once "
                       "per server)", ", ".join(new))


def _text_of(blocks: Any, where: str) -> str:
    """The text of a ``system`` / ``tool_result`` content: a string or a list of text blocks."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise bad_request(f"{where} must be a string or a list of text blocks", where)
    out = []
    for j, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise bad_request(f"{where}[{j}] must be a text block", f"{where}[{j}]", "unsupported_content")
        out.append(b["text"])
    return "\n".join(out)


def _image_part(block: dict[str, Any], where: str) -> dict[str, Any]:
    src = block.get("source")
    if not isinstance(src, dict):
        raise bad_request(f"{where}.source must be an object", f"{where}.source")
    if src.get("type") == "base64":
        media, data = src.get("media_type"), src.get("data")
        if not isinstance(media, str) or not isinstance(data, str):
            raise bad_request(f"{where}.source needs media_type and data strings", f"{where}.source")
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}
    if src.get("type") == "url" and isinstance(src.get("url"), str):
        return {"type": "image_url", "image_url": {"url": src["url"]}}
    raise bad_request(f"{where}.source type {src.get('type')!r} is not supported (base64 or url)",
                      f"{where}.source")


def _turn(m: MessageParam, i: int) -> list[dict[str, Any]]:
    """One Anthropic turn as chat messages (tool results first, as ``tool`` messages)."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, b in enumerate(m.content):
        where = f"messages[{i}].content[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            parts.append({"type": "text", "text": b["text"]})
        elif kind == "image" and m.role == "user":
            parts.append(_image_part(b, where))
        elif kind == "tool_use" and m.role == "assistant":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                raise bad_request(f"{where}: tool_use needs id and name", where)
            calls.append({"id": b["id"], "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}))}})
        elif kind == "tool_result" and m.role == "user":
            if not isinstance(b.get("tool_use_id"), str):
                raise bad_request(f"{where}: tool_result needs tool_use_id", where)
            text = _text_of(b.get("content", ""), f"{where}.content")
            results.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                            "content": f"Error: {text}" if b.get("is_error") else text})
        elif kind in ("thinking", "redacted_thinking") and m.role == "assistant":
            continue  # earlier reasoning is not fed back (as chat templates drop it)
        else:
            raise bad_request(f"{where}: block type {kind!r} is not supported in a {m.role} message", where,
                              "unsupported_content")
    out = results
    if parts or calls or not results:
        msg: dict[str, Any] = {"role": m.role, "content": parts if any(p["type"] != "text" for p in parts)
                               else "\n".join(p["text"] for p in parts)}
        if calls:
            msg["tool_calls"] = calls
            msg["content"] = msg["content"] or None
        out = out + [msg]
    return out


def _tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, t in enumerate(tools):
        if t.get("type") not in (None, "custom") or not isinstance(t.get("name"), str):
            raise bad_request(f"tools[{i}]: only client tools ({{name, input_schema}}) are served here, got type "
                              f"{t.get('type')!r}", f"tools[{i}]", "unsupported_tool")
        schema = t.get("input_schema")
        if not isinstance(schema, dict):
            raise bad_request(f"tools[{i}].input_schema must be a JSON schema object", f"tools[{i}].input_schema")
        fn = {"name": t["name"], "parameters": schema}
        if t.get("description"):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """(chat's tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    parallel = False if choice.get("disable_parallel_tool_use") else None
    kind = choice.get("type")
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise bad_request(f"tool_choice type {kind!r} is not one of auto, any, tool, none", "tool_choice")


def _template_kwargs(req: MessagesRequest) -> dict[str, Any] | None:
    kwargs: dict[str, Any] = {}
    if req.thinking is not None:
        kind = req.thinking.get("type")
        if kind not in ("enabled", "disabled", "adaptive"):
            raise bad_request(f"thinking.type must be enabled, disabled or adaptive, got {kind!r}", "thinking.type")
        kwargs["enable_thinking"] = kind != "disabled"  # the name Qwen3-style templates read
    effort = (req.output_config or {}).get("effort")
    if effort is not None:
        kwargs["reasoning_effort"] = effort
    return kwargs or None


def _response_format(req: MessagesRequest) -> dict[str, Any] | None:
    cfg = req.output_config or {}
    extra = sorted(set(cfg) - {"format", "effort"})
    if extra:
        raise bad_request(f"output_config.{extra[0]} is not an output option", f"output_config.{extra[0]}",
                          "unknown_parameter")
    fmt = cfg.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad_request("output_config.format must be {type: json_schema, schema: {...}}", "output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def to_chat(req: MessagesRequest, stream: bool = False) -> ChatCompletionRequest:
    """The chat completions request that serves ``req`` (greedy-equal to sending it to chat)."""
    if not req.messages:
        raise bad_request("messages must contain at least one message", "messages")
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": _text_of(req.system, "system")})
    for i, m in enumerate(req.messages):
        messages += _turn(m, i)
    choice, parallel = _tool_choice(req.tool_choice)
    body: dict[str, Any] = {
        "model": req.model, "messages": [ChatMessage.model_validate(m) for m in messages],
        "max_tokens": req.max_tokens, "stop": req.stop_sequences, "temperature": req.temperature,
        "top_p": req.top_p, "top_k": req.top_k, "tools": _tools(req.tools) if req.tools else None,
        "tool_choice": choice, "parallel_tool_calls": parallel, "response_format": _response_format(req),
        "chat_template_kwargs": _template_kwargs(req), "stream": stream,
    }
    if stream:  # usage in every chunk: message_start carries the input tokens
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    try:
        return ChatCompletionRequest(**{k: v for k, v in body.items() if v is not None})
    except Exception as e:  # pydantic: a converted value of the wrong type
        raise bad_request(f"messages: {e}", "messages") from None


# Anthropic's error types by HTTP status.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 415: "invalid_request_error",
                429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error"}


def error_body(err: APIError) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def error_response(err: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "x-api-key"} if err.status == 401 else {}
    headers.update(err.headers or {})
    return JSONResponse(error_body(err), status_code=err.status, headers=headers)
