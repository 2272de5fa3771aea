"""The guidance backend (llguidance): the fallback of ``auto`` for JSON-schema features and grammars
xgrammar cannot take (``multipleOf``, Lark grammars, ...). It refuses what it does not implement,
so a request it accepts is enforced in full."""
from __future__ import annotations

import json
from typing import Any, ClassVar

import torch

from vllite_core.sampling_params import StructuredOutputsParams
from vllite_core.structured_output.backend import UnsupportedGrammar, choice_regex


def _grammar(params: StructuredOutputsParams) -> str:
    import llguidance

    if params.json is not None or params.json_object:
        schema = params.json if params.json is not None else '{"type": "object"}'
        options: dict[str, Any] = {"whitespace_flexible": not params.disable_any_whitespace}
        if params.whitespace_pattern:
            options["whitespace_pattern"] = params.whitespace_pattern
        if params.disable_additional_properties:
            loaded = json.loads(schema)
            if isinstance(loaded, dict):
                loaded.setdefault("additionalProperties", False)
            schema = json.dumps(loaded)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if params.regex is not None:
        return llguidance.grammar_from("regex", params.regex)
    if params.choice is not None:
        return llguidance.grammar_from("regex", choice_regex(params.choice))
    if params.grammar is not None:
        return llguidance.grammar_from("grammar", params.grammar)  # Lark, or GBNF converted to Lark
    raise UnsupportedGrammar("guidance: structural_tag is served by xgrammar only")


class GuidanceBackend:
    name: ClassVar[str] = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> None:
        import llguidance.hf

        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_token_id)

    @classmethod
    def check(cls, params: StructuredOutputsParams) -> None:
        import llguidance

        try:
            grammar = _grammar(params)
        except UnsupportedGrammar:
            raise
        except Exception as e:  # noqa: BLE001 - a grammar that does not convert
            raise UnsupportedGrammar(str(e)) from None
        error = llguidance.LLMatcher.validate_grammar(grammar, None)
        if error:
            raise UnsupportedGrammar(error)

    def compile(self, params: StructuredOutputsParams) -> Any:
        return _grammar(params)  # llguidance compiles lazily, per matcher; the grammar text is what is shared

    def matcher(self, compiled: Any) -> "GuidanceMatcher":
        return GuidanceMatcher(self.tokenizer, compiled)


class GuidanceMatcher:
    def __init__(self, tokenizer: Any, grammar: str) -> None:
        import llguidance

        self.m = llguidance.LLMatcher(tokenizer, grammar)
        if self.m.is_error():
            raise UnsupportedGrammar(self.m.get_error())

    def accept_token(self, token_id: int) -> bool:
        return bool(self.m.consume_token(token_id)) and not self.m.is_error()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(self.m, bitmask, row)

    def is_terminated(self) -> bool:
        return bool(self.m.is_stopped())
