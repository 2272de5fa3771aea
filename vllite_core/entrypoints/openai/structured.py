"""Structured output and tool calling on the OpenAI routes: request fields -> StructuredOutputsParams.

Sources, at most one per request: ``response_format`` (``json_schema`` / ``json_object`` / ``text``),
vLLM's ``structured_outputs`` object, the older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar`` fields (removed from vLLM in 0.12, where they are now silently ignored; accepted
here as aliases rather than dropped), and ``tool_choice`` ``required`` or a named function, which is
enforced with a JSON schema built from the tools' parameters: ``required`` as a non-empty array of
``{"name", "parameters"}`` objects (one of the tools each), a named function as its parameters alone.
``tool_choice: "auto"`` is parsed after generation by the serve-time tool parser instead.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from vllite_core.entrypoints.openai.errors import bad_request
from vllite_core.sampling_params import SamplingParamsError, StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


@dataclass
class ToolPlan:
    """How a chat request's tools are answered: ``mode`` none | auto | required | named."""

    mode: str
    tools: list[dict[str, Any]]
    name: str | None = None  # the named function
    parallel: bool = True  # parallel_tool_calls: false means at most one call (``required``)

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        return self.tools if self.tools and self.mode != "none" else None


def _params(field: str, **kw: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kw)
    except SamplingParamsError as e:
        sub = e.param.split(".", 1)[1] if "." in e.param else ""
        raise bad_request(str(e).split(": ", 1)[-1], f"{field}.{sub}" if field == "structured_outputs" else field) \
            from None
    except TypeError as e:
        raise bad_request(str(e), field) from None


def _from_response_format(rf: dict[str, Any]) -> StructuredOutputsParams | None:
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return _params("response_format", json_object=True)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise bad_request("response_format.json_schema must be an object with a 'schema'", "response_format")
        schema = js.get("schema", js.get("json_schema"))
        if not isinstance(schema, (dict, bool)):
            raise bad_request("response_format.json_schema.schema must be a JSON schema object", "response_format")
        return _params("response_format", json=schema if isinstance(schema, dict) else json.dumps(schema))
    raise bad_request(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                      "response_format")


def _tool_name(tool: Any, i: int) -> str:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
        raise bad_request(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", "tools")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"tools[{i}].function.name is missing", "tools")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
    return name


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: Any, parallel_tool_calls: bool | None = None
               ) -> ToolPlan:
    plan = _plan(tools, tool_choice)
    plan.parallel = parallel_tool_calls is not False
    return plan


def _plan(tools: list[dict[str, Any]] | None, tool_choice: Any) -> ToolPlan:
    tools = list(tools or [])
    names = [_tool_name(t, i) for i, t in enumerate(tools)]
    if tool_choice is None:
        return ToolPlan("auto" if tools else "none", tools)
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise bad_request(f"tool_choice must be none, auto, required or a named function, got {tool_choice!r}",
                              "tool_choice")
        if tool_choice != "none" and not tools:
            raise bad_request(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
        return ToolPlan(tool_choice, tools)
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise bad_request("tool_choice must name a function: {'type': 'function', 'function': {'name': ...}}",
                          "tool_choice")
    if name not in names:
        raise bad_request(f"tool_choice names {name!r}, which is not one of the tools", "tool_choice")
    return ToolPlan("named", tools, name)


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def tool_schema(plan: ToolPlan) -> dict[str, Any] | None:
    """The JSON schema that enforces ``required`` / a named function; None for none / auto."""
    if plan.mode == "named":
        tool = next(t for t in plan.tools if t["function"]["name"] == plan.name)
        return _parameters(tool)
    if plan.mode != "required":
        return None
    one_of = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                                "parameters": _parameters(t)},
               "required": ["name", "parameters"]} for t in plan.tools]
    schema = {"type": "array", "minItems": 1, "items": one_of[0] if len(one_of) == 1 else {"anyOf": one_of}}
    if not plan.parallel:
        schema["maxItems"] = 1
    return schema


def structured_outputs_for(req: Any, plan: ToolPlan | None = None) -> tuple[str, StructuredOutputsParams] | None:
    """The request's one structured output constraint and the field it came from (400 naming the field
    when two are given)."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    rf = getattr(req, "response_format", None)
    if rf:
        so = _from_response_format(rf)
        if so is not None:
            found.append(("response_format", so))
    if getattr(req, "guided_decoding_backend", None) is not None:
        raise bad_request("the structured output backend is chosen at engine level (--structured-outputs-backend), "
                          "not per request", "guided_decoding_backend")
    so_field = getattr(req, "structured_outputs", None)
    if so_field is not None:
        if not isinstance(so_field, dict):
            raise bad_request("structured_outputs must be an object", "structured_outputs")
        found.append(("structured_outputs", _params("structured_outputs", **so_field)))
    for name, kind in _GUIDED.items():
        value = getattr(req, name, None)
        if value is not None:
            found.append((name, _params(name, **{kind: value})))
    if plan is not None:
        schema = tool_schema(plan)
        if schema is not None:
            found.append(("tool_choice", _params("tool_choice", json=schema)))
    if len(found) > 1:
        raise bad_request(f"only one structured output constraint per request: got {found[0][0]} and {found[1][0]}",
                          found[1][0])
    return found[0] if found else None


def apply_structured_outputs(engine: Any, req: Any, params: Any, plan: ToolPlan | None = None) -> None:
    """Set ``params.structured_outputs`` from the request, with its backend picked now, so a constraint
    no backend can compile is a 400 naming the request's field (with each backend's reason)."""
    found = structured_outputs_for(req, plan)
    if found is None:
        return
    field, so = found
    try:
        engine.engine.grammar_backends.select(so)
    except SamplingParamsError as e:
        raise bad_request(str(e), field) from None
    params.structured_outputs = so


def tool_calls_from_output(plan: ToolPlan, text: str) -> list[dict[str, Any]]:
    """The tool calls of a ``required`` / named output (the JSON the schema enforced)."""
    from vllite_core.tool_parsers.base import ToolCall

    if plan.mode == "named":
        return [ToolCall(plan.name or "", text.strip()).as_openai()]
    try:
        json.loads(text)
    except ValueError:
        return []
    return [ToolCall(name, args).as_openai() for name, args in required_calls(text) if name is not None]


def required_calls(text: str) -> list[tuple[str | None, str]]:
    """The calls of a ``required`` output (``[{"name": ..., "parameters": {...}}, ...]``) as far as
    ``text`` holds them: (name or None while unknown, raw text of the parameters so far)."""
    from vllite_core.tool_parsers.partial_json import scan_call, skip_ws

    pos = skip_ws(text, 0)
    if not text.startswith("[", pos):
        return []
    out: list[tuple[str | None, str]] = []
    pos += 1
    while True:
        call = scan_call(text, pos, keys=("parameters",))
        if call is None:
            return out
        out.append((call.name, call.arguments))
        if not call.done:
            return out
        pos = skip_ws(text, call.end)
        if not text.startswith(",", pos):
            return out
        pos += 1
