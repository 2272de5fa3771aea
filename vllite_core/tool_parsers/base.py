"""The tool-parser contract and the streaming wrapper every parser shares.

A parser implements ``parse(text, final)``: the assistant content that is certainly not part of a
tool call, and the tool calls that are complete; and ``partial_calls(text)``: the calls as far as they
are generated, each as (name or None, arguments text so far). ``ToolParserStream`` calls both on the
text so far at each streamed delta and sends only what is new: content deltas, and tool-call deltas
shaped as OpenAI's (``CallStream``): first index, id, type and function name, then argument fragments
as they arrive; the fragments of a call concatenate to its final arguments (the raw JSON text of the
arguments, which the non-streamed response carries too).
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

from vllite_core.tool_parsers.partial_json import scan_call


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: default_call_id())

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "type": "function",
                             "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            d["index"] = index
        return d


@dataclass
class ParsedText:
    content: str  # text shown as the message content (may grow while streaming)
    calls: list[ToolCall]


def default_call_id() -> str:
    return "chatcmpl-tool-" + secrets.token_hex(12)


class ToolParser:
    """Base class: subclasses set ``name`` and implement ``parse``. ``tools``: the request's tool
    definitions (OpenAI's shape), for formats whose argument values are typed by the schema.
    ``keeps_special_tokens``: the format's markers are special tokens, so the output text must keep
    them (the request's ``skip_special_tokens`` is turned off, as vLLM does for such parsers)."""

    name: ClassVar[str] = ""
    keeps_special_tokens: ClassVar[bool] = False

    def __init__(self, tokenizer: Any = None, tools: list[dict[str, Any]] | None = None) -> None:
        self.tokenizer = tokenizer
        self.tools = tools or []

    def new_call_id(self) -> str:
        return default_call_id()

    def parse(self, text: str, final: bool) -> ParsedText:
        """Content and complete tool calls in ``text``. While not ``final``, content must exclude any
        tail that could still become a tool call."""
        raise NotImplementedError

    def partial_calls(self, text: str) -> list[tuple[str | None, str]]:
        """The calls in ``text`` as far as generated: (name, or None while unknown; arguments so far, a
        prefix of the final arguments). By default the complete calls only (they stream whole)."""
        return [(c.name, c.arguments) for c in self.parse(text, final=False).calls]

    @staticmethod
    def call_from_text(body: str) -> ToolCall | None:
        """The JSON text of one call -> ToolCall with the raw text of its arguments (None if not a call)."""
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        call = ToolParser.call_from_json(obj)
        scanned = scan_call(body, 0)
        if call is not None and scanned is not None and scanned.done:
            call.arguments = scanned.arguments
        return call

    @staticmethod
    def call_from_json(obj: Any, args_key: str = "arguments") -> ToolCall | None:
        """{"name": ..., "arguments"|"parameters": {...}} -> ToolCall (None if it is not one)."""
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get(args_key, obj.get("parameters", obj.get("arguments", {})))
        return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))


class CallStream:
    """The tool-call deltas of one streamed choice, OpenAI-shaped: a call's first delta carries index, id,
    type and function name (with the arguments known so far, often ""), later ones argument fragments."""

    def __init__(self, new_id: Callable[[], str] = default_call_id) -> None:
        self.sent: list[str] = []  # arguments sent, per call index
        self.new_id = new_id

    def deltas(self, calls: list[tuple[str | None, str]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for i, (name, args) in enumerate(calls):
            if name is None:
                break  # calls stream in order: nothing after one whose name is still unknown
            if i == len(self.sent):
                out.append(ToolCall(name, args, self.new_id()).as_openai(i))
                self.sent.append(args)
            elif len(args) > len(self.sent[i]) and args.startswith(self.sent[i]):
                out.append({"index": i, "function": {"arguments": args[len(self.sent[i]):]}})
                self.sent[i] = args
        return out


class ToolParserStream:
    """One streamed choice: feed it the text so far, get the content delta and the tool-call deltas."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.sent_content = 0
        self.calls = CallStream(parser.new_call_id)

    def feed(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        parsed = self.parser.parse(text, final)
        content = parsed.content[self.sent_content:] if len(parsed.content) > self.sent_content else ""
        self.sent_content = max(self.sent_content, len(parsed.content))
        calls = [(c.name, c.arguments) for c in parsed.calls] if final else self.parser.partial_calls(text)
        return content, self.calls.deltas(calls)


def load_tool_parsers(plugin_manager: Any) -> dict[str, type]:
    parsers: dict[str, type] = {}
    for result in reversed(plugin_manager.hook.vllite_register_tool_parsers()):
        for name, cls in (result or {}).items():
            parsers.setdefault(name, cls)
    return parsers
