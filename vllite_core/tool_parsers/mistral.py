"""Mistral tool calls, in both of its tokenizers' forms (``[TOOL_CALLS]`` and ``[ARGS]`` are control
tokens, so the parser asks for special tokens in the output text):

- tokenizer v3 to v7: ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]``;
- v11 and later (Mistral Small 3.2, Magistral, Devstral): ``[TOOL_CALLS]f[ARGS]{...}`` once per call
  (v13 puts ``[CALL_ID]id`` before ``[ARGS]``).

Mistral's chat templates check that a tool call id is 9 letters or digits when it is sent back, so the
calls get such ids (as vLLM gives them).
"""
from __future__ import annotations

import secrets
import string
from typing import ClassVar

from vllite_core.tool_parsers.base import ParsedText, ToolCall
from vllite_core.tool_parsers.partial_json import skip_ws, value_end
from vllite_core.tool_parsers.tagged_json import TaggedJsonArrayParser

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_ALNUM = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


class MistralToolParser(TaggedJsonArrayParser):
    name: ClassVar[str] = "mistral"
    tags: ClassVar[tuple[str, ...]] = (TOOL_CALLS,)
    keeps_special_tokens: ClassVar[bool] = True

    def make_call(self, name: str, arguments: str) -> ToolCall:
        return ToolCall(name, arguments, id=mistral_call_id())

    def new_call_id(self) -> str:
        return mistral_call_id()

    @staticmethod
    def _named_form(text: str, at: int) -> bool:
        pos = skip_ws(text, at + len(TOOL_CALLS))
        return pos < len(text) and text[pos] not in "[{"

    def parse(self, text: str, final: bool) -> ParsedText:
        at = text.find(TOOL_CALLS)
        if at < 0 or not self._named_form(text, at):
            return super().parse(text, final)
        calls, complete = self._named_calls(text, at)
        if not final:
            return ParsedText(text[:at], [self.make_call(n, a) for n, a, done in calls if done])
        if not calls or not complete:
            return ParsedText(text, [])  # a call that does not parse: the text is content
        return ParsedText(text[:at], [self.make_call(n, a) for n, a, _ in calls])

    def partial_calls(self, text: str) -> list[tuple[str | None, str]]:
        at = text.find(TOOL_CALLS)
        if at < 0 or not self._named_form(text, at):
            return super().partial_calls(text)
        calls, _ = self._named_calls(text, at)
        return [(n, a) for n, a, _ in calls]

    @staticmethod
    def _named_calls(text: str, at: int) -> tuple[list[tuple[str | None, str, bool]], bool]:
        """(name, arguments so far, done) per ``[TOOL_CALLS]name[ARGS]{...}`` call from ``at``; and
        whether everything after the first tag was well-formed calls."""
        out: list[tuple[str | None, str, bool]] = []
        pos = at
        while pos < len(text):
            if not text.startswith(TOOL_CALLS, pos):
                return out, False
            head_end = text.find(ARGS, pos)
            if head_end < 0:  # the name is still being generated
                out.append((None, "", False))
                return out, False
            name = text[pos + len(TOOL_CALLS):head_end]
            if CALL_ID in name:
                name = name[:name.find(CALL_ID)]
            name = name.strip()
            start = skip_ws(text, head_end + len(ARGS))
            end = value_end(text, start)
            if end is None or not name:
                partial = text[start:] if start < len(text) and text[start] in "{[" else ""
                out.append((name or None, partial, False))
                return out, False
            out.append((name, text[start:end], True))
            pos = skip_ws(text, end)
        return out, True
