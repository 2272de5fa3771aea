"""Tool-call parsers: turn a model's text into OpenAI tool calls (``tool_choice: "auto"``), chosen at
serve time with ``--enable-auto-tool-choice --tool-call-parser NAME``; registered through the
``vllite_register_tool_parsers`` hook."""
from vllite_core.tool_parsers.base import ToolCall, ToolParser, ToolParserStream, load_tool_parsers

__all__ = ["ToolCall", "ToolParser", "ToolParserStream", "load_tool_parsers"]
