"""Function tools on /v1/responses, on chat's tool machinery (structured.plan_tools, ToolOutput).

The Responses API's shapes differ from chat's: tools are ``{"type": "function", "name", "parameters"}``
(flat), a named choice is ``{"type": "function", "name"}``, calls come out as ``function_call`` output
items (``call_id``, ``name``, ``arguments``) and go back in as ``function_call`` input items followed by
``function_call_output`` items. Here each is turned into chat's form and back, so a tool call through
Responses is what chat gives for the same conversation (grammar-forced for required / named choices,
parsed by --tool-call-parser for auto).
"""
from __future__ import annotations

import uuid
from typing import Any

from vllite_core.entrypoints.openai.errors import bad_request
from vllite_core.entrypoints.openai.protocol import ChatMessage
from vllite_core.entrypoints.openai.structured import ToolPlan, plan_tools


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise bad_request(f"tools[{i}]: tool type {kind!r} is not served here (only function tools)", "tools",
                              "unsupported_parameter")
        if not isinstance(t.get("name"), str):
            raise bad_request(f"tools[{i}].name is missing", "tools")
        fn = {"name": t["name"], "parameters": t.get("parameters") or {"type": "object", "properties": {}}}
        if t.get("description"):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice must be none, auto, required or {type: function, name}", "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def plan(req: Any) -> ToolPlan:
    return plan_tools(chat_tools(req.tools), chat_tool_choice(req.tool_choice), req.parallel_tool_calls)


def function_call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    """A chat tool call (``{"id", "function": {"name", "arguments"}}``) as a ``function_call`` output item."""
    return {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}


def call_message(item: dict[str, Any], where: str) -> ChatMessage:
    """A ``function_call`` input item as the assistant's chat message with one tool call."""
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise bad_request(f"{where}.{key} must be a string", f"{where}.{key}")
    call = {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}
    return ChatMessage(role="assistant", content=None, tool_calls=[call])


def output_message(item: dict[str, Any], where: str) -> ChatMessage:
    """A ``function_call_output`` input item as a chat ``tool`` message."""
    if not isinstance(item.get("call_id"), str):
        raise bad_request(f"{where}.call_id must be a string", f"{where}.call_id")
    output = item.get("output")
    if not isinstance(output, str):
        raise bad_request(f"{where}.output must be a string", f"{where}.output")
    return ChatMessage(role="tool", content=output, tool_call_id=item["call_id"])


def merge_calls(messages: list[ChatMessage]) -> list[ChatMessage]:
    """Consecutive one-call assistant messages (one input item per call) as one message with all the calls,
    as chat sends a turn with parallel calls."""
    out: list[ChatMessage] = []
    for m in messages:
        prev = out[-1] if out else None
        calls = (m.model_extra or {}).get("tool_calls")
        if (calls and m.role == "assistant" and prev is not None and prev.role == "assistant"
                and (prev.model_extra or {}).get("tool_calls") and not m.content):
            out[-1] = prev.model_copy(update={"tool_calls": [*prev.model_extra["tool_calls"], *calls]})
            continue
        out.append(m)
    return out
