"""Tool calls as XML-like blocks whose parameters are text, not JSON:

- ``qwen3_coder`` (Qwen3-Coder, Qwen3.5):
  ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>``;
- ``glm45`` (GLM-4.5 / 4.6): ``<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n</tool_call>``.

Content is the text before the first block. Values are typed by the request's tool schema
(``xml_params``). Streamed, a call's name goes out once written and its arguments grow by whole
parameters (``arguments_so_far``), closed when the block closes.
"""
from __future__ import annotations

import re
from typing import ClassVar

from vllite_core.tool_parsers.base import ParsedText, ToolCall, ToolParser
from vllite_core.tool_parsers.tagged_json import partial_tag_at_end
from vllite_core.tool_parsers.xml_params import arguments_so_far, param_types, typed_value

Block = tuple[str | None, list[tuple[str, str]], bool]  # (name, raw (key, value) pairs, closed)


class XmlToolParser(ToolParser):
    """Base: subclasses set ``open_tag`` / ``close_tag`` and read one block's inside in ``read_block``."""

    open_tag: ClassVar[str] = "<tool_call>"
    close_tag: ClassVar[str] = "</tool_call>"

    def read_block(self, inner: str, closed: bool) -> tuple[str | None, list[tuple[str, str]]]:
        """(name, raw (key, value) pairs) of a block's inside (``closed``: its close tag came)."""
        raise NotImplementedError

    def block_start(self, text: str, pos: int = 0) -> int:
        return text.find(self.open_tag, pos)

    def _blocks(self, text: str) -> list[Block]:
        out: list[Block] = []
        pos = self.block_start(text)
        while pos >= 0:
            start = pos + len(self.open_tag) if text.startswith(self.open_tag, pos) else pos
            end = text.find(self.close_tag, start)
            inner = text[start:] if end < 0 else text[start:end]
            name, pairs = self.read_block(inner, end >= 0)
            out.append((name, pairs, end >= 0))
            if end < 0:
                break
            pos = self.block_start(text, end + len(self.close_tag))
        return out

    def _call(self, name: str, pairs: list[tuple[str, str]], closed: bool) -> tuple[str, str]:
        types = param_types(self.tools, name)
        return name, arguments_so_far([(k, typed_value(v, types.get(k))) for k, v in pairs], closed)

    def parse(self, text: str, final: bool) -> ParsedText:
        first = self.block_start(text)
        if first < 0:
            keep = 0 if final else partial_tag_at_end(text, (self.open_tag,))
            return ParsedText(text[:len(text) - keep], [])
        blocks = self._blocks(text)
        # a block the generation ended inside counts when it ended, with its name (the close tag is often
        # the stop token's text, so it may be missing)
        calls = [ToolCall(*self._call(n, p, True)) for n, p, closed in blocks
                 if n and (closed or final)]
        if final and not calls:
            return ParsedText(text, [])
        return ParsedText(text[:first], calls)

    def partial_calls(self, text: str) -> list[tuple[str | None, str]]:
        out: list[tuple[str | None, str]] = []
        for name, pairs, closed in self._blocks(text):
            if not name:
                out.append((None, ""))
                break
            out.append(self._call(name, pairs, closed))
        return out


def _strip_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    return value[:-1] if value.endswith("\n") else value


class Qwen3CoderToolParser(XmlToolParser):
    name: ClassVar[str] = "qwen3_coder"
    _FUNCTION = re.compile(r"<function=([^>\n]+)>")
    _PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)

    def block_start(self, text: str, pos: int = 0) -> int:
        """A block opens with ``<tool_call>``, or with ``<function=`` where the model left that out."""
        hits = [i for i in (text.find(self.open_tag, pos), text.find("<function=", pos)) if i >= 0]
        return min(hits) if hits else -1

    def read_block(self, inner: str, closed: bool) -> tuple[str | None, list[tuple[str, str]]]:
        m = self._FUNCTION.search(inner)
        if m is None:
            return None, []
        body = inner[m.end():]
        body = body[:body.find("</function>")] if "</function>" in body else body
        return m.group(1).strip(), [(k.strip(), _strip_newline(v)) for k, v in self._PARAM.findall(body)]


class Glm45ToolParser(XmlToolParser):
    name: ClassVar[str] = "glm45"
    _PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def read_block(self, inner: str, closed: bool) -> tuple[str | None, list[tuple[str, str]]]:
        cut = [i for i in (inner.find("<arg_key>"), inner.find("\n")) if i >= 0]
        if not cut and not closed:
            return None, []  # the name may still be growing
        name = (inner[:min(cut)] if cut else inner).strip()
        return (name or None), [(k.strip(), v) for k, v in self._PAIR.findall(inner)]


