"""Chat's reasoning output (``--reasoning-parser``): the message's and each delta's ``reasoning``.

vLLM renamed ``reasoning_content`` (DeepSeek's name) to ``reasoning`` and later dropped the old
name; both are sent here, with the same text, so clients written for either version read it."""
from __future__ import annotations

from typing import Any

from vllite_core.reasoning import ReasoningStream


def _reasoning_fields(reasoning: str | None) -> dict[str, Any]:
    return {"reasoning": reasoning, "reasoning_content": reasoning}


def message_fields(parser: Any, text: str) -> dict[str, Any]:
    """``content`` (and, with a parser, ``reasoning`` / ``reasoning_content``) of a whole output."""
    if parser is None:
        return {"content": text}
    reasoning, content = parser.extract(text)
    return {"content": content, **_reasoning_fields(reasoning)}


class DeltaSplitter:
    """Per choice, the delta fields of each streamed piece of output."""

    def __init__(self, parser: Any) -> None:
        self.parser = parser
        self.streams: dict[int, ReasoningStream] = {}

    def delta(self, index: int, text: str, token_ids: Any, finished: bool) -> dict[str, Any]:
        if self.parser is None:
            return {"content": text} if text else {}
        s = self.streams.get(index)
        if s is None:
            s = self.streams[index] = self.parser.stream()
        r, c = s.feed(text, list(token_ids or ()))
        if finished:
            fr, fc = s.finish()
            r = (r or "") + (fr or "") or None
            c = (c or "") + (fc or "") or None
        out: dict[str, Any] = {}
        if r:
            out.update(_reasoning_fields(r))
        if c:
            out["content"] = c
        return out
