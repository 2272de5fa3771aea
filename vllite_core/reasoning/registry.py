"""Reasoning parsers by name, from every plugin's ``vllite_register_reasoning_parsers`` hook."""
from __future__ import annotations

from typing import Any


class ReasoningParserError(ValueError):
    """An unknown ``--reasoning-parser`` name (the message lists the known ones)."""

    param = "reasoning_parser"


def _all_parsers(plugin_manager: Any = None) -> dict[str, type]:
    if plugin_manager is None:
        from vllite_core.plugins.manager import get_plugin_manager

        plugin_manager = get_plugin_manager()
    found: dict[str, type] = {}
    # pluggy answers last-registered first: reversed, a plugin's name replaces a built-in's.
    for answer in reversed(plugin_manager.hook.vllite_register_reasoning_parsers()):
        found.update(answer or {})
    return found


def reasoning_parser_names(plugin_manager: Any = None) -> list[str]:
    return sorted(_all_parsers(plugin_manager))


def get_reasoning_parser(name: str, tokenizer: Any, plugin_manager: Any = None) -> Any:
    """The parser called ``name``, built for ``tokenizer``; ReasoningParserError naming the known ones."""
    parsers = _all_parsers(plugin_manager)
    if name not in parsers:
        raise ReasoningParserError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(parsers))}")
    return parsers[name](tokenizer)
