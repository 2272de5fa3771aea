"""The outlines backend (outlines-core): every constraint becomes a regex and a token-level automaton
(``Index``). It has no grammars and no structural tags; ``auto`` reaches it when neither xgrammar nor
guidance can take a request (e.g. a regex feature only its engine has)."""
from __future__ import annotations

import json
from typing import Any, ClassVar

import torch

from vllite_core.sampling_params import StructuredOutputsParams
from vllite_core.structured_output.backend import UnsupportedGrammar, choice_regex

# Bounds outlines-core's schema-to-regex drops without a word (0.2.x): a schema with them would be
# followed unbounded (it wrote 100000000000000 for a maximum of 99), so such a schema is not outlines' to take.
_NUMERIC_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


def _numeric_bounds(node: Any) -> list[str]:
    """The numeric bound keywords anywhere in a schema (a property merely named "minimum" holds a schema,
    not a number, and does not count)."""
    if isinstance(node, list):
        return [k for item in node for k in _numeric_bounds(item)]
    if not isinstance(node, dict):
        return []
    found = [k for k in _NUMERIC_BOUNDS if isinstance(node.get(k), (int, float)) and not isinstance(node.get(k), bool)]
    return found + [k for v in node.values() for k in _numeric_bounds(v)]


def _regex(params: StructuredOutputsParams) -> str:
    from outlines_core.json_schema import build_regex_from_schema

    if params.json is not None or params.json_object:
        schema = params.json if params.json is not None else '{"type": "object"}'
        bounds = _numeric_bounds(json.loads(schema))
        if bounds:
            raise UnsupportedGrammar(f"outlines: numeric bounds are not enforced ({', '.join(sorted(set(bounds)))})")
        if params.disable_additional_properties:
            loaded = json.loads(schema)
            if isinstance(loaded, dict):
                loaded.setdefault("additionalProperties", False)
            schema = json.dumps(loaded)
        ws = params.whitespace_pattern or ("" if params.disable_any_whitespace else None)
        return build_regex_from_schema(schema, ws) if ws is not None else build_regex_from_schema(schema)
    if params.regex is not None:
        return params.regex
    if params.choice is not None:
        return choice_regex(params.choice)
    raise UnsupportedGrammar(f"outlines: {params.kind} is not supported (regular languages only)")


def _token_bytes(tokenizer: Any) -> dict[int, bytes]:
    """Each ordinary token's bytes: byte-level BPE strings mapped back through GPT-2's byte table,
    SentencePiece pieces with '▁' as a space and <0xNN> as that byte."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    inverse = {c: b for b, c in bytes_to_unicode().items()}
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    out: dict[int, bytes] = {}
    for text, tid in tokenizer.get_vocab().items():
        if tid in special:
            continue
        if all(c in inverse for c in text):
            out[tid] = bytes(inverse[c] for c in text)
        elif len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            out[tid] = bytes([int(text[3:5], 16)])
        else:
            out[tid] = text.replace("\u2581", " ").encode("utf-8")
    return out


class OutlinesBackend:
    name: ClassVar[str] = "outlines"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> None:
        from outlines_core import Vocabulary

        if eos_token_id is None:
            raise UnsupportedGrammar("outlines needs the model's EOS token")
        by_bytes: dict[bytes, list[int]] = {}
        for tid, b in _token_bytes(tokenizer).items():
            if tid < vocab_size and tid != eos_token_id and b:
                by_bytes.setdefault(b, []).append(tid)
        self.vocab = Vocabulary(eos_token_id, by_bytes)

    @classmethod
    def check(cls, params: StructuredOutputsParams) -> None:
        try:
            _regex(params)
        except UnsupportedGrammar:
            raise
        except Exception as e:  # noqa: BLE001 - outlines raises ValueError/TypeError with the reason
            raise UnsupportedGrammar(str(e)) from None

    def compile(self, params: StructuredOutputsParams) -> Any:
        from outlines_core import Index

        return Index(_regex(params), self.vocab)

    def matcher(self, compiled: Any) -> "OutlinesMatcher":
        return OutlinesMatcher(compiled, self.vocab.get_eos_token_id())


class OutlinesMatcher:
    def __init__(self, index: Any, eos_token_id: int) -> None:
        from outlines_core import Guide

        self.guide = Guide(index)
        self.eos = eos_token_id
        self.ended = False

    def accept_token(self, token_id: int) -> bool:
        if self.ended:
            return False
        if token_id == self.eos:  # the guide offers EOS in a final state but does not advance on it
            self.ended = self.guide.is_finished()
            return self.ended
        if not self.guide.accepts_tokens([token_id]):
            return False
        self.guide.advance(token_id, return_tokens=False)
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        target = bitmask[row]
        self.guide.write_mask_into(target.data_ptr(), target.numel(), target.element_size())

    def is_terminated(self) -> bool:
        return self.ended
