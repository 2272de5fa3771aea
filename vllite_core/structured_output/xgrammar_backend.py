"""The xgrammar backend: the first choice of ``auto`` (fast compile, a token-mask cache per grammar).

xgrammar ignores some JSON-schema keywords with only a warning (``multipleOf``, ``uniqueItems``, ...):
an output would then not validate, so ``check`` refuses schemas that use them and ``auto`` falls back.
"""
from __future__ import annotations

import json
from typing import Any, ClassVar

import torch

from vllite_core.sampling_params import StructuredOutputsParams
from vllite_core.structured_output.backend import UnsupportedGrammar, choice_regex

# Keywords xgrammar would drop silently, by where they appear.
_UNSUPPORTED = {
    "multipleOf": "numbers with multipleOf",
    "uniqueItems": "arrays with uniqueItems",
    "contains": "arrays with contains",
    "minContains": "arrays with minContains",
    "maxContains": "arrays with maxContains",
    "patternProperties": "objects with patternProperties",
    "propertyNames": "objects with propertyNames",
    "dependentSchemas": "objects with dependentSchemas",
    "if": "conditional schemas (if/then/else)",
    "not": "negated schemas (not)",
}


def _unsupported_json_feature(schema: Any) -> str | None:
    """The first schema feature xgrammar would not enforce, or None."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        for key, what in _UNSUPPORTED.items():
            if key in node and not (key == "uniqueItems" and node[key] is False):
                return what
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            import xgrammar as xgr
            try:
                xgr.Grammar.from_regex(pattern)
            except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError with the reason
                return f"string pattern {pattern!r}: {_short(e)}"
        for key, value in node.items():
            if key not in ("enum", "const", "default", "examples"):
                stack.append(value)
    return None


def _short(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    return msg.split("] ", 1)[-1] if msg.startswith("[") else msg


def _structural_tag(spec: str) -> tuple[list[Any], list[str]]:
    import xgrammar as xgr

    tag = json.loads(spec)
    structures = tag.get("structures")
    triggers = tag.get("triggers")
    if not isinstance(structures, list) or not isinstance(triggers, list) or not structures:
        raise UnsupportedGrammar("structural_tag must have non-empty 'structures' and a 'triggers' list")
    items = []
    for s in structures:
        if not isinstance(s, dict) or not {"begin", "end"} <= s.keys():
            raise UnsupportedGrammar("each structure needs 'begin', 'schema' and 'end'")
        schema = s.get("schema", {})
        items.append(xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(schema), end=s["end"]))
    return items, [str(t) for t in triggers]


class XgrammarBackend:
    name: ClassVar[str] = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> None:
        import xgrammar as xgr

        stop = [eos_token_id] if eos_token_id is not None else None
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop)
        # Thread-safe: the manager's pool compiles several grammars at once. No cache here: the manager
        # keeps compiled grammars, bounded by bytes (xgrammar's own cache would grow without bound).
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    @classmethod
    def check(cls, params: StructuredOutputsParams) -> None:
        import xgrammar as xgr

        try:
            if params.json is not None:
                schema = json.loads(params.json)
                feature = _unsupported_json_feature(schema)
                if feature:
                    raise UnsupportedGrammar(f"xgrammar does not enforce {feature}")
                xgr.Grammar.from_json_schema(params.json, any_whitespace=not params.disable_any_whitespace)
            elif params.regex is not None:
                xgr.Grammar.from_regex(params.regex)
            elif params.choice is not None:
                xgr.Grammar.from_regex(choice_regex(params.choice))
            elif params.grammar is not None:
                xgr.Grammar.from_ebnf(params.grammar)
            elif params.structural_tag is not None:
                items, triggers = _structural_tag(params.structural_tag)
                xgr.Grammar.from_structural_tag(items, triggers)
        except UnsupportedGrammar:
            raise
        except Exception as e:  # noqa: BLE001 - xgrammar's parse errors are RuntimeErrors with the reason
            raise UnsupportedGrammar(_short(e)) from None

    def compile(self, params: StructuredOutputsParams) -> Any:
        c = self.compiler
        if params.json is not None:
            return c.compile_json_schema(params.json, any_whitespace=not params.disable_any_whitespace)
        if params.json_object:  # an object, as OpenAI's json_object means (the builtin grammar takes any value)
            return c.compile_json_schema('{"type": "object"}', any_whitespace=not params.disable_any_whitespace)
        if params.regex is not None:
            return c.compile_regex(params.regex)
        if params.choice is not None:
            return c.compile_regex(choice_regex(params.choice))
        if params.grammar is not None:
            return c.compile_grammar(params.grammar)
        items, triggers = _structural_tag(params.structural_tag or "{}")
        return c.compile_structural_tag(items, triggers)

    def matcher(self, compiled: Any) -> "XgrammarMatcher":
        return XgrammarMatcher(compiled)


class XgrammarMatcher:
    def __init__(self, compiled: Any) -> None:
        import xgrammar as xgr

        self.m = xgr.GrammarMatcher(compiled)

    def accept_token(self, token_id: int) -> bool:
        return bool(self.m.accept_token(token_id))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.m.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return bool(self.m.is_terminated())
