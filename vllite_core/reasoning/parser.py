"""The parser contract and the ``<think>...</think>`` state machine both built-ins share.

A parser object is made once per server with the model's tokenizer; ``extract`` splits a whole
output, ``stream()`` gives a per-choice ``ReasoningStream`` that splits deltas. Tags are found in
the text, holding back a tail that could be the start of a tag split across deltas; where the
tokenizer has a tag as one token and the detokenizer dropped its text (a special token), the
token id marks the boundary instead.
"""
from __future__ import annotations

from typing import Any, ClassVar

from vllite_core.tool_parsers.tagged_json import partial_tag_at_end

Split = tuple[str | None, str | None]  # (reasoning, content); None where there is none


def none_if_empty(s: str) -> str | None:
    return s or None


def _find_any(text: str, tags: tuple[str, ...]) -> tuple[int, str]:
    """The earliest of ``tags`` in ``text`` (the longest where two start together); (-1, "") if none."""
    hits = [(text.find(t), -len(t), t) for t in tags if t in text]
    if not hits:
        return -1, ""
    at, _, tag = min(hits)
    return at, tag


class ReasoningStream:
    """Split one choice's streamed deltas. ``feed`` returns the (reasoning, content) text each
    delta adds (None for nothing); ``finish`` flushes what was held back as a possible tag."""

    def __init__(self, parser: "ThinkTagParser") -> None:
        self.p = parser
        self.state = parser.initial_state  # "lead" (deepseek_r1), "content_pre", "reasoning", "content"
        self.held = ""
        self.reasoning = ""
        self.content = ""

    def _mark_special(self, text: str, token_ids: list[int]) -> str:
        """Put back the text of a tag whose single token the detokenizer skipped."""
        for tag, tid in ((self.p.start_tag, self.p.start_id), (self.p.end_tag, self.p.end_id)):
            if tid is not None and tid in token_ids and tag not in self.held + text:
                text = tag + text if token_ids.index(tid) == 0 else text + tag
        return text

    def feed(self, text: str, token_ids: list[int] | tuple[int, ...] = ()) -> Split:
        buf = self.held + self._mark_special(text, list(token_ids))
        self.held = ""
        r, c = "", ""
        while buf:
            if self.state == "lead":  # deepseek_r1: reasoning from the start; one leading <think> is dropped
                tag = self.p.start_tag
                if tag.startswith(buf):
                    self.held = buf if len(buf) < len(tag) else ""
                    if len(buf) == len(tag):
                        self.state = "reasoning"
                    buf = ""
                    continue
                if buf.startswith(tag):
                    buf = buf[len(tag):]
                self.state = "reasoning"
                continue
            if self.state == "content":
                c += buf
                break
            tags = self.p.end_tags if self.state == "reasoning" else self.p.start_tags
            at, tag = _find_any(buf, tags)
            if at >= 0:
                if self.state == "reasoning":
                    r += buf[:at]
                    self.state = "content"
                else:
                    c += buf[:at]
                    self.state = "reasoning"
                buf = buf[at + len(tag):]
                continue
            keep = partial_tag_at_end(buf, tags)
            out, self.held = buf[:len(buf) - keep], buf[len(buf) - keep:]
            if self.state == "reasoning":
                r += out
            else:
                c += out
            break
        self.reasoning += r
        self.content += c
        return none_if_empty(r), none_if_empty(c)

    def finish(self) -> Split:
        """The held-back tail (it was no tag after all) where it belongs."""
        held, self.held = self.held, ""
        if not held:
            return None, None
        if self.state in ("reasoning", "lead"):
            self.reasoning += held
            return held, None
        self.content += held
        return None, held


class ReasoningParser:
    """Base of every reasoning parser (the hook's classes subclass it). ``tokenizer``: the model's.
    ``keeps_special_tokens``: the format's markers are special tokens the output text must keep (the
    request's ``skip_special_tokens`` is turned off)."""

    keeps_special_tokens: ClassVar[bool] = False

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def extract(self, text: str) -> Split:
        raise NotImplementedError

    def stream(self) -> ReasoningStream:
        raise NotImplementedError


class ThinkTagParser(ReasoningParser):
    """Reasoning between a start and an end tag; ``start_tags`` / ``end_tags`` list every spelling the
    format allows (the first is the one a single token may stand for)."""

    start_tag = "<think>"
    end_tag = "</think>"
    initial_state = "reasoning"

    @property
    def start_tags(self) -> tuple[str, ...]:
        return (self.start_tag,)

    @property
    def end_tags(self) -> tuple[str, ...]:
        return (self.end_tag,)

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self.start_id = self._single_token(self.start_tag)
        self.end_id = self._single_token(self.end_tag)

    def _single_token(self, tag: str) -> int | None:
        """The tag's id when the tokenizer has it as one added token (token ids then mark it)."""
        added = getattr(self.tokenizer, "added_tokens_decoder", None) or {}
        return next((i for i, t in added.items() if getattr(t, "content", None) == tag), None)

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)

    def extract(self, text: str) -> Split:
        s = self.stream()
        s.feed(text)
        s.finish()
        return none_if_empty(s.reasoning), none_if_empty(s.content)


class DeepSeekR1ReasoningParser(ThinkTagParser):
    """DeepSeek-R1: the output starts inside the reasoning (the template opens ``<think>``);
    everything up to ``</think>`` is reasoning, an optional leading ``<think>`` is dropped.
    No ``</think>`` at all: the whole output is reasoning."""

    initial_state = "lead"


class Qwen3ReasoningParser(ThinkTagParser):
    """Qwen3: reasoning only between ``<think>`` and ``</think>``. A whole output without both
    tags is all content (vLLM's qwen3 parser); streamed, text after ``<think>`` is reasoning as it
    comes (it cannot wait for an end tag that may never come)."""

    initial_state = "content_pre"

    def extract(self, text: str) -> Split:
        if self.start_tag not in text or self.end_tag not in text:
            return None, none_if_empty(text)
        return super().extract(text)
