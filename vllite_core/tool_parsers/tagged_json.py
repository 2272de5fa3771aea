"""Tool calls as a JSON array after a tag: Mistral's pre-v11 ``[TOOL_CALLS][{...}, ...]`` and IBM
Granite's ``<|tool_call|>[{...}]`` (Granite 3.0) or ``<tool_call>[{...}]`` (3.1 and later).

Content is the text before the tag; while streaming, a tail that could still become the tag is held back.
"""
from __future__ import annotations

import json
from typing import ClassVar

from vllite_core.tool_parsers.base import ParsedText, ToolCall, ToolParser
from vllite_core.tool_parsers.partial_json import scan_call_array


def partial_tag_at_end(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of one of ``tags``."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if tag.startswith(text[-n:]):
                best = n
                break
    return best


def find_first(text: str, tags: tuple[str, ...]) -> tuple[int, str]:
    """The earliest position of any of ``tags`` in ``text`` and the tag found there ((-1, "") if none)."""
    hits = [(text.find(t), t) for t in tags if t in text]
    return min(hits, key=lambda h: (h[0], -len(h[1]))) if hits else (-1, "")


class TaggedJsonArrayParser(ToolParser):
    """Base: subclasses set ``tags``, any of which opens the array of calls."""

    tags: ClassVar[tuple[str, ...]] = ()

    def make_call(self, name: str, arguments: str) -> ToolCall:
        return ToolCall(name, arguments)

    def parse(self, text: str, final: bool) -> ParsedText:
        at, tag = find_first(text, self.tags)
        if at < 0:
            keep = 0 if final else partial_tag_at_end(text, self.tags)
            return ParsedText(text[:len(text) - keep], [])
        body = text[at + len(tag):].strip()
        try:
            items = json.loads(body) if final else None
        except ValueError:
            items = None
        if not final:
            scanned = scan_call_array(body, 0) or []
            calls = [self.make_call(c.name, c.arguments) for c in scanned if c.done and c.name is not None]
            return ParsedText(text[:at], calls)
        if isinstance(items, dict):
            items = [items]
        calls = [c for c in (ToolParser.call_from_json(i) for i in items or []) if c is not None]
        if not calls or len(calls) != len(items or []):
            return ParsedText(text, [])  # not calls after all: all of it is content
        raw = scan_call_array(body if body.startswith("[") else "[" + body + "]", 0) or []
        for call, scanned in zip(calls, raw):  # the arguments as the model wrote them
            if scanned.done:
                call.arguments = scanned.arguments
        return ParsedText(text[:at], [self.make_call(c.name, c.arguments) for c in calls])

    def partial_calls(self, text: str) -> list[tuple[str | None, str]]:
        at, tag = find_first(text, self.tags)
        if at < 0:
            return []
        scanned = scan_call_array(text, at + len(tag)) or []
        return [(c.name, c.arguments) for c in scanned]


class GraniteToolParser(TaggedJsonArrayParser):
    name: ClassVar[str] = "granite"
    tags: ClassVar[tuple[str, ...]] = ("<|tool_call|>", "<tool_call>")
