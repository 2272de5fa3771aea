"""Structured output: grammars compiled by a backend chosen for the whole engine, enforced by a
per-step token bitmask. See docs/structured_output.md."""
from vllite_core.structured_output.backend import (
    GrammarMatcher,
    StructuredOutputBackend,
    UnsupportedGrammar,
)
from vllite_core.structured_output.manager import (
    BackendSelector,
    GrammarBitmask,
    RequestGrammar,
    StructuredOutputManager,
)

__all__ = ["BackendSelector", "GrammarBitmask", "GrammarMatcher", "RequestGrammar", "StructuredOutputBackend",
           "StructuredOutputManager", "UnsupportedGrammar"]
