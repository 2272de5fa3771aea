"""Reading tool calls out of JSON text that is still being generated, so their arguments can stream.

A call is a JSON object with a ``name`` string and its arguments under ``arguments`` or ``parameters``.
``scan_call`` reads as much of one as the text holds: the name once its string is closed, and the
arguments as the raw text of their value so far. That raw text only grows as the text grows (an object
or array value is cut at its closing bracket; a string or number value is held back until it ends), so
what was sent of it is always a prefix of the final arguments, which are that same raw text.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

_WS = " \t\n\r"
ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass
class PartialCall:
    name: str | None  # None until the name's string is closed
    arguments: str  # raw JSON text of the arguments value so far ("" before it starts)
    done: bool  # the call object is closed; ``end`` is the index after it
    end: int = 0


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos


def _string_end(text: str, pos: int) -> int | None:
    """Index after the JSON string starting at ``text[pos] == '"'``; None if it is not closed yet."""
    i = pos + 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def value_end(text: str, pos: int) -> int | None:
    """Index after the JSON value starting at ``pos``; None while it is incomplete."""
    if pos >= len(text):
        return None
    c = text[pos]
    if c == '"':
        return _string_end(text, pos)
    if c in "{[":
        depth, i = 0, pos
        while i < len(text):
            c = text[i]
            if c == '"':
                end = _string_end(text, i)
                if end is None:
                    return None
                i = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    i = pos  # a number or a literal: it has ended only where something else follows
    while i < len(text) and text[i] not in _WS + ",}]":
        i += 1
    return i if i < len(text) else None


def scan_call(text: str, pos: int, keys: tuple[str, ...] = ARGUMENT_KEYS) -> PartialCall | None:
    """The call object starting at ``pos`` (whitespace skipped) as far as ``text`` holds it; None when
    what is there is not (the start of) a JSON object."""
    pos = skip_ws(text, pos)
    if pos >= len(text):
        return PartialCall(None, "", False)
    if text[pos] != "{":
        return None
    call = PartialCall(None, "", False)
    have_args = False
    pos += 1
    while True:
        pos = skip_ws(text, pos)
        if pos >= len(text):
            return call
        if text[pos] == "}":
            call.done, call.end = True, pos + 1
            if not have_args:
                call.arguments = "{}"
            return call
        if text[pos] == ",":
            pos += 1
            continue
        if text[pos] != '"':
            return None
        key_end = _string_end(text, pos)
        if key_end is None:
            return call
        key = json.loads(text[pos:key_end])
        pos = skip_ws(text, key_end)
        if pos >= len(text):
            return call
        if text[pos] != ":":
            return None
        start = skip_ws(text, pos + 1)
        end = value_end(text, start)
        if key in keys and not have_args:
            if end is None:  # streaming: an object or array shows what it has so far
                if start < len(text) and text[start] in "{[":
                    call.arguments = text[start:]
                return call
            raw = text[start:end]
            value = json.loads(raw) if raw.startswith('"') else None
            call.arguments = value if isinstance(value, str) else raw  # arguments given as a JSON string
            have_args = True
        elif end is None:
            return call
        elif key == "name" and call.name is None and text[start] == '"':
            call.name = json.loads(text[start:end])
        pos = end


def scan_call_array(text: str, pos: int) -> list[PartialCall] | None:
    """The calls of a JSON array of call objects starting at ``pos`` (whitespace skipped), as far as
    ``text`` holds them (the last one may be partial); None when what is there is not such an array."""
    pos = skip_ws(text, pos)
    if pos >= len(text):
        return []
    if text[pos] != "[":
        return None
    out: list[PartialCall] = []
    pos += 1
    while True:
        pos = skip_ws(text, pos)
        if pos >= len(text) or text[pos] == "]":
            return out
        if text[pos] == ",":
            pos += 1
            continue
        call = scan_call(text, pos)
        if call is None:
            return None
        out.append(call)
        if not call.done:
            return out
        pos = call.end
