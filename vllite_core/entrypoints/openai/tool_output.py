"""Chat responses with tool calls: the message (or stream delta) for each choice's text.

``required`` / named: the text is the JSON the tool schema enforced; it becomes ``tool_calls``
(streamed as it is generated: the named function's header at once, its arguments token by token;
under ``required`` each call once its name is read). ``auto``: the serve-time tool parser splits
content from calls, as the text streams. Arguments are the raw JSON text the model wrote, streamed
and not alike. Choices that called tools finish with ``finish_reason: "tool_calls"``.
"""
from __future__ import annotations

from typing import Any

from vllite_core.entrypoints.openai.structured import ToolPlan, required_calls, tool_calls_from_output
from vllite_core.tool_parsers.base import CallStream, ToolParserStream


class ToolOutput:
    def __init__(self, plan: ToolPlan, parser_cls: Any) -> None:
        self.plan = plan
        self.parser = parser_cls(None, plan.tools) if plan.mode == "auto" and parser_cls is not None else None
        self.texts: dict[int, str] = {}
        self.streams: dict[int, ToolParserStream] = {}
        self.call_streams: dict[int, CallStream] = {}  # required / named
        self.called: set[int] = set()

    def _finish(self, finish: str | None, calls: bool) -> str | None:
        return "tool_calls" if calls and finish == "stop" else finish

    def message(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        if self.plan.mode in ("required", "named"):
            calls = tool_calls_from_output(self.plan, text)
            return {"role": "assistant", "content": None if calls else text, "tool_calls": calls}, \
                self._finish(finish, bool(calls))
        if self.parser is not None:
            parsed = self.parser.parse(text, final=True)
            calls = [c.as_openai() for c in parsed.calls]
            msg: dict[str, Any] = {"role": "assistant", "content": parsed.content or None if calls else text,
                                   "tool_calls": calls}
            return msg, self._finish(finish, bool(calls))
        return {"role": "assistant", "content": text}, finish

    def delta(self, index: int, piece: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        if self.plan.mode in ("none",) or (self.plan.mode == "auto" and self.parser is None):
            return ({"content": piece} if piece else {}), finish
        text = self.texts[index] = self.texts.get(index, "") + piece
        final = finish is not None
        if self.plan.mode in ("required", "named"):
            if self.plan.mode == "named":  # the text is the arguments; surrounding whitespace is not
                partial = [(self.plan.name, text.strip())]
            elif final:
                partial = [(c["function"]["name"], c["function"]["arguments"])
                           for c in tool_calls_from_output(self.plan, text)]
            else:
                partial = required_calls(text)
            stream = self.call_streams.setdefault(index, CallStream())
            deltas = stream.deltas(partial)
            if final and not stream.sent:  # no call came out (cut short): the text is content
                return {"content": text}, finish
            return ({"tool_calls": deltas} if deltas else {}), self._finish(finish, True) if final else None
        stream = self.streams.setdefault(index, ToolParserStream(self.parser))
        content, calls = stream.feed(text, final)
        if calls:
            self.called.add(index)
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta, self._finish(finish, index in self.called)
