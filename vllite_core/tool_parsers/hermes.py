"""Hermes-style tool calls (Qwen, Hermes, SmolLM2's own template): ``<tool_call>{json}</tool_call>``."""
from __future__ import annotations

import re
from typing import ClassVar

from vllite_core.tool_parsers.base import ParsedText, ToolCall, ToolParser
from vllite_core.tool_parsers.partial_json import scan_call

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)


def _partial_open_at_end(text: str) -> int:
    """Length of the longest tail of ``text`` that is a prefix of the open tag (it may become one)."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


class HermesToolParser(ToolParser):
    name: ClassVar[str] = "hermes"

    def parse(self, text: str, final: bool) -> ParsedText:
        first = text.find(OPEN)
        if first < 0:
            content = text if final else text[:len(text) - _partial_open_at_end(text)]
            return ParsedText(content, [])
        calls: list[ToolCall] = []
        for m in _BLOCK.finditer(text):
            call = _load(m.group(1))
            if call is not None:
                calls.append(call)
        if final:
            tail = text[text.rfind(OPEN):]
            if CLOSE not in tail:  # generation ended inside a call (no closing tag): take it if it parses
                call = _load(tail[len(OPEN):].strip())
                if call is not None:
                    calls.append(call)
        if final and not calls:
            return ParsedText(text, [])  # nothing parsed as a call: it was all content
        return ParsedText(text[:first], calls)

    def partial_calls(self, text: str) -> list[tuple[str | None, str]]:
        out: list[tuple[str | None, str]] = []
        pos = text.find(OPEN)
        while pos >= 0:
            call = scan_call(text, pos + len(OPEN))
            if call is None:  # not JSON after the tag: nothing to stream (the final parse decides)
                break
            out.append((call.name, call.arguments))
            if not call.done:
                break
            pos = text.find(OPEN, call.end)
        return out


def _load(body: str) -> ToolCall | None:
    return ToolParser.call_from_text(body)
