"""Chat's legacy ``functions`` / ``function_call`` (OpenAI's pre-tools form, still sent by older clients
and frameworks) on the tools path.

The request: ``functions`` become function ``tools``, ``function_call`` ("none", "auto" or
``{"name": ...}``) becomes ``tool_choice``, one call at most (the legacy form has no parallel calls).
The conversation: an assistant message's ``function_call`` becomes a one-call ``tool_calls``, and a
``function`` message becomes the ``tool`` message answering it. The answer is given back in the legacy
shape: ``message.function_call`` (streamed as ``delta.function_call`` pieces) and ``finish_reason``
"function_call" where tools would say "tool_calls".
"""
from __future__ import annotations

from typing import Any

from vllite_core.entrypoints.openai.errors import bad_request
from vllite_core.entrypoints.openai.protocol import ChatMessage


def _tool_choice(function_call: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if function_call is None or function_call in ("none", "auto"):
        return function_call
    if isinstance(function_call, dict) and set(function_call) == {"name"} and isinstance(function_call["name"], str):
        return {"type": "function", "function": {"name": function_call["name"]}}
    raise bad_request('function_call must be "none", "auto" or {"name": NAME}', "function_call")


def _messages(messages: list[ChatMessage]) -> list[ChatMessage]:
    """Legacy turns as tool turns: each call gets an id, and the ``function`` result after it names it."""
    out: list[ChatMessage] = []
    pending: dict[str, str] = {}  # function name -> id of its latest call
    for i, m in enumerate(messages):
        extra = dict(m.model_extra or {})
        call = extra.pop("function_call", None)
        if m.role == "assistant" and call is not None:
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                raise bad_request(f"messages[{i}].function_call needs a name and arguments",
                                  f"messages[{i}].function_call")
            cid = f"call_fn{i}"
            pending[call["name"]] = cid
            fn = {"name": call["name"], "arguments": call.get("arguments") or "{}"}
            m = ChatMessage(role="assistant", content=m.content, name=m.name, **extra,
                            tool_calls=[{"id": cid, "type": "function", "function": fn}])
        elif m.role == "function":
            if not m.name:
                raise bad_request(f"messages[{i}]: a function message needs the function's name",
                                  f"messages[{i}].name")
            m = ChatMessage(role="tool", content=m.content, name=m.name,
                            tool_call_id=pending.get(m.name, f"call_fn_{m.name}"))
        out.append(m)
    return out


def translate(req: Any) -> Any:
    """The request with its legacy fields as tools (``functions`` stays set: it asks for the legacy answer)."""
    legacy_turns = any(m.role == "function" or (m.model_extra or {}).get("function_call") is not None
                       for m in req.messages)
    if req.functions is None and req.function_call is None and not legacy_turns:
        return req
    update: dict[str, Any] = {"messages": _messages(req.messages)} if legacy_turns else {}
    if req.function_call is not None and req.functions is None:
        raise bad_request("function_call needs functions", "function_call")
    if req.functions is not None:
        if req.tools is not None:
            raise bad_request("send either functions (deprecated) or tools, not both", "functions")
        if req.tool_choice is not None and req.function_call is not None:
            raise bad_request("send either function_call (deprecated) or tool_choice, not both", "function_call")
        update["tools"] = [{"type": "function", "function": f} for f in req.functions]
        if req.function_call is not None:
            update["tool_choice"] = _tool_choice(req.function_call)
        update["parallel_tool_calls"] = False
    return req.model_copy(update=update)


def _finish(finish: str | None) -> str | None:
    return "function_call" if finish == "tool_calls" else finish


def message(msg: dict[str, Any], finish: str | None) -> tuple[dict[str, Any], str | None]:
    """A tools answer in the legacy shape: its (only) call as ``function_call``."""
    calls = msg.pop("tool_calls", None) or []
    if calls:
        msg["function_call"] = dict(calls[0]["function"])
    return msg, _finish(finish)


def delta(d: dict[str, Any], finish: str | None) -> tuple[dict[str, Any], str | None]:
    """A streamed tools delta in the legacy shape: the call's name, then its argument pieces."""
    calls = d.pop("tool_calls", None) or []
    if calls:
        fn = calls[0].get("function") or {}
        d["function_call"] = {k: fn[k] for k in ("name", "arguments") if fn.get(k) is not None}
    return d, _finish(finish)
