"""Reasoning parsers: split a reasoning model's output into its reasoning and its answer.

Parsers are registered by name through the ``vllite_register_reasoning_parsers`` hook (built-ins
in ``vllite_core.reasoning.builtin``); ``get_reasoning_parser(name)`` looks one up.
"""
from vllite_core.reasoning.parser import ReasoningParser, ReasoningStream, ThinkTagParser
from vllite_core.reasoning.registry import ReasoningParserError, get_reasoning_parser, reasoning_parser_names

__all__ = ["ReasoningParser", "ReasoningStream", "ThinkTagParser", "ReasoningParserError", "get_reasoning_parser",
           "reasoning_parser_names"]
