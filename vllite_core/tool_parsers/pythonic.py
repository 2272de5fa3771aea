"""Python-syntax tool calls (Llama 3.2 and Llama 4's pythonic format): the message is a list of calls
with keyword arguments, ``[get_weather(city="Paris", unit="celsius"), get_time()]``, optionally
between Llama 4's ``<|python_start|>`` and ``<|python_end|>``.

The text is read with Python's own parser (``ast``), never evaluated: only literal argument values
(strings, numbers, booleans, None, lists, dicts) are accepted; anything else leaves the message as
content. Arguments become JSON objects. While streaming, a message that starts with ``[`` is held back;
each call goes out once it is complete (its name as soon as it is written).
"""
from __future__ import annotations

import ast
import json
import re
from typing import Any, ClassVar

from vllite_core.tool_parsers.base import ParsedText, ToolCall, ToolParser

START, END = "<|python_start|>", "<|python_end|>"
_OPEN_CALL = re.compile(r"([A-Za-z_][\w.]*)\s*\($")


def _body(text: str) -> str:
    body = text.strip()
    if body.startswith(START):
        body = body[len(START):]
    if body.endswith(END):
        body = body[:-len(END)]
    return body.strip()


def _calls(source: str) -> list[tuple[str, str]] | None:
    """(name, JSON arguments) per call when ``source`` is a list of calls with literal keyword arguments."""
    try:
        tree = ast.parse(source, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    out = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = ast.unparse(node.func)
        if not re.fullmatch(r"[A-Za-z_][\w.]*", name):
            return None
        args: dict[str, Any] = {}
        for kw in node.keywords:
            if kw.arg is None:
                return None
            try:
                args[kw.arg] = ast.literal_eval(kw.value)
            except ValueError:
                return None
        out.append((name, json.dumps(args, ensure_ascii=False)))
    return out


def _complete(body: str) -> tuple[list[tuple[str, str]], int]:
    """The calls complete in ``body`` (a list still being written): the longest prefix that, closed with
    ``]``, parses as calls, and that prefix's length (1, the bracket, when none is complete)."""
    for k in range(len(body), 1, -1):
        if body[k - 1] != ")":
            continue
        calls = _calls(body[:k] + "]")
        if calls is not None:
            return calls, k
    return [], 1


class PythonicToolParser(ToolParser):
    name: ClassVar[str] = "pythonic"

    def parse(self, text: str, final: bool) -> ParsedText:
        body = _body(text)
        if not final:
            if not body or body.startswith("[") or START.startswith(text.strip()):
                return ParsedText("", [ToolCall(n, a) for n, a in _complete(body)[0]])
            return ParsedText(text, [])
        calls = _calls(body)
        if calls is None:
            return ParsedText(text, [])
        return ParsedText("", [ToolCall(n, a) for n, a in calls])

    def partial_calls(self, text: str) -> list[tuple[str | None, str]]:
        body = _body(text)
        if not body.startswith("["):
            return []
        done, consumed = _complete(body)
        out: list[tuple[str | None, str]] = list(done)
        tail = body[consumed:]
        m = re.match(r"\s*,?\s*([A-Za-z_][\w.]*)\s*\(", tail)
        if m:  # the next call's name is written: it goes out with empty arguments for now
            out.append((m.group(1), ""))
        return out
