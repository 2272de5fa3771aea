"""DeepSeek-V3 / R1 tool calls (``deepseek_v3``), and DeepSeek-V3.1's shorter form (``deepseek_v31``):

- V3: ``<｜tool▁calls▁begin｜>``, then per call
  ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>``,
  then ``<｜tool▁calls▁end｜>``;
- V3.1: ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`` inside the same outer markers.

(The markers use the full-width bar U+FF5C and U+2581, as DeepSeek's tokenizer writes them.) Content
is the text before the outer marker. Both names read both forms.
"""
from __future__ import annotations

from typing import ClassVar

from vllite_core.tool_parsers.base import ParsedText, ToolCall, ToolParser
from vllite_core.tool_parsers.partial_json import skip_ws, value_end
from vllite_core.tool_parsers.tagged_json import partial_tag_at_end

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE = "```json"


def _call(text: str, pos: int) -> tuple[str | None, str, bool, int]:
    """(name, arguments so far, done, index after the call) of the call whose begin marker is at ``pos``."""
    sep = text.find(SEP, pos)
    if sep < 0:
        return None, "", False, len(text)
    kind = text[pos + len(CALL_BEGIN):sep].strip()
    start = sep + len(SEP)
    if kind == "function":  # V3: the name on its own line, then a fenced JSON block
        line_end = text.find("\n", start)
        if line_end < 0:
            return None, "", False, len(text)
        name = text[start:line_end].strip()
        start = skip_ws(text, line_end)
        if not text.startswith(FENCE, start):
            return (name, "", False, len(text)) if FENCE.startswith(text[start:]) else (None, "", False, -1)
        start = skip_ws(text, start + len(FENCE))
    else:  # V3.1: the name before the separator, the JSON right after it
        name = kind
    start = skip_ws(text, start)
    end = value_end(text, start)
    if end is None:
        return name, text[start:] if text[start:start + 1] in ("{", "[") else "", False, len(text)
    close = text.find(CALL_END, end)
    return name, text[start:end], close >= 0, (close + len(CALL_END)) if close >= 0 else len(text)


class DeepSeekV3ToolParser(ToolParser):
    name: ClassVar[str] = "deepseek_v3"

    def _calls(self, text: str) -> list[tuple[str | None, str, bool]]:
        out: list[tuple[str | None, str, bool]] = []
        pos = text.find(CALL_BEGIN)
        while pos >= 0:
            name, args, done, end = _call(text, pos)
            if end < 0:
                break
            out.append((name, args, done))
            if not done:
                break
            pos = text.find(CALL_BEGIN, end)
        return out

    def parse(self, text: str, final: bool) -> ParsedText:
        at = text.find(CALLS_BEGIN)
        if at < 0:
            keep = 0 if final else partial_tag_at_end(text, (CALLS_BEGIN,))
            return ParsedText(text[:len(text) - keep], [])
        # at the end a call cut before its end marker counts if its JSON is whole
        calls = [ToolCall(n, a) for n, a, done in self._calls(text)
                 if n and (done or (final and value_end(a, 0) == len(a) and a))]
        if final and not calls:
            return ParsedText(text, [])
        return ParsedText(text[:at], calls)

    def partial_calls(self, text: str) -> list[tuple[str | None, str]]:
        if CALLS_BEGIN not in text:
            return []
        return [(n, a) for n, a, _ in self._calls(text)]
