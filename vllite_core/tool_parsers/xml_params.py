"""Parameter values written as text inside XML-like tags (Qwen3-Coder, GLM-4.5): typed by the request's
tool schema, as the formats' own serving code does: a string parameter stays text, numbers, booleans,
objects and arrays are read as JSON (then as a Python literal); a parameter the schema does not name is
read as JSON when it is JSON, else kept as text."""
from __future__ import annotations

import ast
import json
from typing import Any


def param_types(tools: list[dict[str, Any]], function: str) -> dict[str, str]:
    """JSON-schema type per parameter of ``function`` among the request's tools ({} if unknown)."""
    for tool in tools:
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        if fn.get("name") == function:
            props = (fn.get("parameters") or {}).get("properties") or {}
            return {k: v.get("type", "") if isinstance(v, dict) else "" for k, v in props.items()}
    return {}


def typed_value(raw: str, kind: Any) -> Any:
    if kind == "string" or (isinstance(kind, list) and "string" in kind and len(kind) == 1):
        return raw
    if raw.lower() in ("null", "none") and kind != "string":
        return None
    if kind == "boolean" and raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    try:
        value = json.loads(raw)
    except ValueError:
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            return raw
    if kind == "integer" and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def arguments_so_far(pairs: list[tuple[str, Any]], closed: bool) -> str:
    """The JSON text of the arguments from the parameters complete so far: ``{"a": 1, "b": "x"`` grows
    only by appending, and ``}`` ends it once the call is closed, so what was streamed is always a prefix
    of the final arguments."""
    body = ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}" for k, v in pairs)
    return "{" + body + ("}" if closed else "")
