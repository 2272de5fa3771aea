"""Llama 3.x JSON tool calls: the message is ``{"name": ..., "parameters": {...}}`` (optionally after
``<|python_tag|>``; several calls separated by ``;``)."""
from __future__ import annotations

import json
from typing import ClassVar

from vllite_core.tool_parsers.base import ParsedText, ToolCall, ToolParser

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
                obj, end = decoder.raw_decode(body, pos)
            except ValueError:
                return ParsedText(text, [])  # not tool calls after all: plain content
            call = ToolParser.call_from_json(obj)
            if call is None:
                return ParsedText(text, [])
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \n\t;":
                pos += 1
        return ParsedText("", calls)
