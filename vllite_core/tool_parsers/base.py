"""The tool-parser contract and the streaming wrapper every parser shares.

A parser implements ``parse(text, final)``: the assistant content that is certainly not part of a
tool call, and the tool calls that are complete. ``ToolParserStream`` calls it on the text so far at
each streamed delta and sends only what is new: content deltas, then each tool call once, whole, as
an OpenAI tool-call delta (index, id, type, name and arguments), which clients accumulate as usual.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: "chatcmpl-tool-" + secrets.token_hex(12))

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


class ToolParser:
    """Base class: subclasses set ``name`` and implement ``parse``."""

    name: ClassVar[str] = ""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    def parse(self, text: str, final: bool) -> ParsedText:
        """Content and complete tool calls in ``text``. While not ``final``, content must exclude any
        tail that could still become a tool call."""
        raise NotImplementedError

    @staticmethod
    def call_from_json(obj: Any, args_key: str = "arguments") -> ToolCall | None:
        """{"name": ..., "arguments"|"parameters": {...}} -> ToolCall (None if it is not one)."""
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get(args_key, obj.get("parameters", obj.get("arguments", {})))
        return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))


class ToolParserStream:
    """One streamed choice: feed it the text so far, get the content delta and the new tool calls."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.sent_content = 0
        self.sent_calls = 0

    def feed(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        parsed = self.parser.parse(text, final)
        content = parsed.content[self.sent_content:] if len(parsed.content) > self.sent_content else ""
        self.sent_content = max(self.sent_content, len(parsed.content))
        new = [c.as_openai(self.sent_calls + i) for i, c in enumerate(parsed.calls[self.sent_calls:])]
        self.sent_calls = max(self.sent_calls, len(parsed.calls))
        return content, new


def load_tool_parsers(plugin_manager: Any) -> dict[str, type]:
    parsers: dict[str, type] = {}
    for result in reversed(plugin_manager.hook.vllite_register_tool_parsers()):
        for name, cls in (result or {}).items():
            parsers.setdefault(name, cls)
    return parsers
