"""Llama 3.x JSON tool calls: the message is ``{"name": ..., "parameters": {...}}`` (optionally after
``<|python_tag|>``; several calls separated by ``;``)."""
from __future__ import annotations

import json
from typing import ClassVar

from vllite_core.tool_parsers.base import ParsedText, ToolCall, ToolParser
from vllite_core.tool_parsers.partial_json import scan_call, skip_ws

TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name: ClassVar[str] = "llama3_json"

    def parse(self, text: str, final: bool) -> ParsedText:
        body = text.strip()
        if body.startswith(TAG):
            body = body[len(TAG):].strip()
        if not body.startswith("{"):
            if not final and (TAG.startswith(body) or not body):
                return ParsedText("", [])
            return ParsedText(text, [])
        if not final:
            return ParsedText("", [])  # a JSON call is taken whole, at the end
        calls: list[ToolCall] = []
        decoder = json.JSONDecoder()
        pos = 0
        while pos < len(body):
            try:
                _, end = decoder.raw_decode(body, pos)
            except ValueError:
                return ParsedText(text, [])  # not tool calls after all: plain content
            call = ToolParser.call_from_text(body[pos:end])
            if call is None:
                return ParsedText(text, [])
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \n\t;":
                pos += 1
        return ParsedText("", calls)

    def partial_calls(self, text: str) -> list[tuple[str | None, str]]:
        """Streams calls optimistically once the message starts with ``{`` (a message that turns out
        not to be calls then ends as content, after fragments went out)."""
        pos = skip_ws(text, 0)
        if text.startswith(TAG, pos):
            pos += len(TAG)
        out: list[tuple[str | None, str]] = []
        while True:
            call = scan_call(text, pos)
            if call is None:
                return out
            out.append((call.name, call.arguments))
            if not call.done:
                return out
            pos = skip_ws(text, call.end)
            while pos < len(text) and text[pos] == ";":
                pos = skip_ws(text, pos + 1)
