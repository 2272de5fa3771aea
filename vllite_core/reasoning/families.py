"""Reasoning parsers of model families beyond the ``<think>`` pair (vLLM's names):

- ``granite``: IBM Granite 3.2's plain-text markers, "Here is my thought process:" then
  "Here is my response:" (also spelled "Here's");
- ``mistral``: Magistral's ``[THINK]`` ... ``[/THINK]`` (control tokens: kept in the text);
- ``glm45``: GLM-4.5's ``<think>`` pair, read as ``qwen3`` reads it;
- ``openai_gptoss``: gpt-oss's harmony ``analysis`` channel is the reasoning; the content is the
  messages for the user, and tool-call messages passed on in harmony form for the ``openai`` tool parser.
"""
from __future__ import annotations

from typing import Any, ClassVar

from vllite_core.reasoning.parser import Qwen3ReasoningParser, ReasoningParser, Split, ThinkTagParser, none_if_empty
from vllite_core.tool_parsers.harmony import call_markup, read_messages, visible_body


class GraniteReasoningParser(ThinkTagParser):
    start_tag = "Here is my thought process:"
    end_tag = "Here is my response:"
    initial_state = "content_pre"

    @property
    def start_tags(self) -> tuple[str, ...]:
        return (self.start_tag, "Here's my thought process:")

    @property
    def end_tags(self) -> tuple[str, ...]:
        return (self.end_tag, "Here's my response:")

    def extract(self, text: str) -> Split:
        if not any(t in text for t in self.start_tags):
            return None, none_if_empty(text)
        return super().extract(text)


class MistralReasoningParser(ThinkTagParser):
    """Reasoning from ``[THINK]`` to ``[/THINK]`` (or to the end when the model stopped inside it);
    without ``[THINK]`` the whole output is content."""

    start_tag = "[THINK]"
    end_tag = "[/THINK]"
    initial_state = "content_pre"
    keeps_special_tokens: ClassVar[bool] = True


class Glm45ReasoningParser(Qwen3ReasoningParser):
    pass


def _harmony_split(text: str, final: bool) -> tuple[str, str]:
    """(reasoning, content) of harmony output as far as it is certain."""
    reasoning, content = [], []
    for m in read_messages(text, final):
        if not m.header_done:
            break
        body = m.body if final else visible_body(m)
        if m.channel == "analysis":
            reasoning.append(body)
        elif m.tool_name:
            content.append(call_markup(m.tool_name, body, m.closed))
        else:
            content.append(body)
    return "".join(reasoning), "".join(content)


class HarmonyStream:
    """Deltas of a harmony output: the whole text is re-read at each piece and what is new sent."""

    def __init__(self) -> None:
        self.text = ""
        self.sent = ("", "")

    def _delta(self, split: tuple[str, str]) -> Split:
        out = []
        for new, old in zip(split, self.sent):
            out.append(new[len(old):] if new.startswith(old) else "")
        self.sent = (self.sent[0] + out[0], self.sent[1] + out[1])
        return none_if_empty(out[0]), none_if_empty(out[1])

    def feed(self, text: str, token_ids: Any = ()) -> Split:
        self.text += text
        return self._delta(_harmony_split(self.text, False))

    def finish(self) -> Split:
        return self._delta(_harmony_split(self.text, True))


class GptOssReasoningParser(ReasoningParser):
    keeps_special_tokens: ClassVar[bool] = True

    def extract(self, text: str) -> Split:
        reasoning, content = _harmony_split(text, True)
        return none_if_empty(reasoning), none_if_empty(content)

    def stream(self) -> HarmonyStream:  # type: ignore[override]
        return HarmonyStream()
