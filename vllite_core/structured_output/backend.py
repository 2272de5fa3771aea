"""The contract between the engine and a grammar backend (xgrammar, llguidance, outlines-core, a plugin's).

A backend class is registered by name through the ``vllite_register_structured_output_backends`` hook.
``check`` is a class method, cheap and tokenizer-free: the frontend calls it to pick the backend of a
request (and to refuse a request no backend can take) before it is queued. The engine builds one
instance per backend, lazily, with the engine's tokenizer and the model's vocabulary size; ``compile``
runs in a worker thread and its result is cached by the grammar spec; every request gets its own
``GrammarMatcher`` over the shared compiled grammar.

Bitmasks are int32 ``[rows, ceil(vocab / 32)]``: bit ``t % 32`` of word ``t // 32`` set means token
``t`` is allowed (the layout xgrammar, llguidance and outlines-core all write).
"""
from __future__ import annotations

from typing import Any, ClassVar, Protocol

import torch

from vllite_core.sampling_params import StructuredOutputsParams


class UnsupportedGrammar(ValueError):
    """A backend cannot compile this request's constraint (the message says why)."""


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class GrammarMatcher(Protocol):
    """One request's position in its grammar."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by one generated token; False if the grammar does not allow it."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (EOS only where the grammar may end)."""

    def is_terminated(self) -> bool:
        """The grammar has ended (its EOS was accepted, or nothing can follow)."""


class StructuredOutputBackend(Protocol):
    name: ClassVar[str]

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> None: ...

    @classmethod
    def check(cls, params: StructuredOutputsParams) -> None:
        """Raise UnsupportedGrammar if this backend cannot enforce ``params`` (no tokenizer needed)."""

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar (shared by every request with the same spec; called in a worker thread)."""

    def matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the start of ``compiled``."""


def choice_regex(choices: list[str]) -> str:
    """A regex matching exactly one of ``choices`` (metacharacters escaped; the same text for every backend)."""
    meta = set("\\.^$*+?{}[]|()/")
    def esc(s: str) -> str:
        return "".join("\\" + c if c in meta else ("\\n" if c == "\n" else ("\\t" if c == "\t" else c)) for c in s)
    return "(" + "|".join(esc(c) for c in choices) + ")"
