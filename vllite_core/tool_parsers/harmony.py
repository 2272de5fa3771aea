"""gpt-oss's harmony format, read from the output text (its markers are special tokens, so the parsers
ask for them to be kept). After the prompt's ``<|start|>assistant`` the model writes messages:

    <|channel|>analysis<|message|>...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>
    <|start|>assistant<|channel|>final<|message|>...<|return|>

A message's header (up to ``<|message|>``) names its channel and, for a tool call, its recipient
(``to=functions.NAME``, before or after the channel); its body ends at ``<|end|>``, ``<|call|>`` or
``<|return|>`` (the last two are stop tokens, often absent from the text) or at the end of the text.
``analysis`` is reasoning; a message to ``functions.*`` is a tool call; the rest is content.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from vllite_core.tool_parsers.tagged_json import partial_tag_at_end

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")


@dataclass
class HarmonyMessage:
    channel: str | None
    recipient: str | None
    body: str
    closed: bool  # its end marker came (or, in a final read, the text ended)
    header_done: bool = True

    @property
    def tool_name(self) -> str | None:
        if self.recipient and self.recipient.startswith("functions."):
            return self.recipient[len("functions."):]
        return None


def read_messages(text: str, final: bool) -> list[HarmonyMessage]:
    """The messages in ``text`` as far as written. Text that has no harmony markers at all is one
    content message (a model or template that did not use the format)."""
    if CHANNEL not in text and MESSAGE not in text and START not in text:
        keep = 0 if final else held_back(text, (START, CHANNEL, MESSAGE))
        return [HarmonyMessage(None, None, text[:len(text) - keep], final)]
    out: list[HarmonyMessage] = []
    pos = 0
    while pos < len(text):
        head_end = text.find(MESSAGE, pos)
        plain = text.find(START, pos, head_end if head_end >= 0 else len(text))
        if plain > pos:  # text before a message's start marker: plain content
            out.append(HarmonyMessage(None, None, text[pos:plain], True))
            pos = plain + len(START)
            continue
        if head_end < 0:
            out.append(HarmonyMessage(None, None, "", False, header_done=False))
            break
        header = text[pos:head_end]
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        start = head_end + len(MESSAGE)
        ends = [(text.find(e, start), e) for e in ENDS if e in text[start:]]
        if ends:
            end, marker = min(ends)
            out.append(HarmonyMessage(channel and channel.group(1), recipient and recipient.group(1),
                                      text[start:end], True))
            pos = end + len(marker)
            if text.startswith(START, pos):
                pos += len(START)
            continue
        out.append(HarmonyMessage(channel and channel.group(1), recipient and recipient.group(1),
                                  text[start:], final))
        break
    return out


def held_back(body: str, markers: tuple[str, ...] = ENDS) -> int:
    """How much of a still-open body's tail could be the start of one of ``markers``."""
    return partial_tag_at_end(body, markers)


def visible_body(message: HarmonyMessage) -> str:
    """A message's body as far as it is certain (an open one's possible end-marker tail held back)."""
    if message.closed or message.channel is None and message.recipient is None and not message.header_done:
        return message.body
    return message.body[:len(message.body) - held_back(message.body)]


def call_markup(name: str, arguments: str, closed: bool) -> str:
    """A tool-call message written back in harmony form (what the reasoning parser passes on as content,
    so the ``openai`` tool parser reads the call)."""
    return (f"{START}assistant{CHANNEL}commentary to=functions.{name} <|constrain|>json{MESSAGE}{arguments}"
            + ("<|call|>" if closed else ""))
