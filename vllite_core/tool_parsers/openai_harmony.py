"""The ``openai`` tool parser: gpt-oss tool calls, read from its harmony messages (``harmony``): every
message addressed to ``functions.NAME`` is a call whose body is the JSON arguments; content is the text of
the messages for the user (the ``final`` channel, or plain text); ``analysis`` messages are left to the
reasoning parser (``openai_gptoss``) and never become content."""
from __future__ import annotations

from typing import ClassVar

from vllite_core.tool_parsers.base import ParsedText, ToolCall, ToolParser
from vllite_core.tool_parsers.harmony import read_messages, visible_body


class OpenAIToolParser(ToolParser):
    name: ClassVar[str] = "openai"
    keeps_special_tokens: ClassVar[bool] = True

    def parse(self, text: str, final: bool) -> ParsedText:
        content, calls = [], []
        for m in read_messages(text, final):
            if not m.header_done:
                break
            if m.tool_name:
                if m.closed:
                    calls.append(ToolCall(m.tool_name, m.body.strip()))
            elif m.channel != "analysis":
                content.append(visible_body(m) if not final else m.body)
        return ParsedText("".join(content), calls)

    def partial_calls(self, text: str) -> list[tuple[str | None, str]]:
        out: list[tuple[str | None, str]] = []
        for m in read_messages(text, False):
            if not m.header_done:
                break
            if m.tool_name:
                out.append((m.tool_name, (m.body if m.closed else visible_body(m)).strip()))
        return out
