"""Incremental detokenization and stop strings.

Text is decoded from a small window of tokens (prefix_offset..read_offset) so
each step costs O(1) tokens, and nothing is emitted while the window ends in an
incomplete UTF-8 sequence (decoded as U+FFFD), so a multi-byte character is
never split across deltas.
"""
from __future__ import annotations

from typing import Any

from vllite_core.sampling_params import SamplingParams

_INITIAL_WINDOW = 5


def _rust_decoder(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` a transformers fast tokenizer's ``decode`` ends in, when nothing in between
    changes the text (its class keeps the base ``_decode``): called directly, two decodes per token cost about
    a fifth of going through transformers' argument handling (~1 ms of a batch-64 decode step). None: use
    ``decode``."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: the generic path
        return None
    if not isinstance(tokenizer, TokenizersBackend) or type(tokenizer)._decode is not TokenizersBackend._decode:
        return None
    return tokenizer.backend_tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tok = tokenizer
        self.params = params
        self.skip_special = params.skip_special_tokens
        self.token_ids: list[int] = list(prompt_token_ids[-_INITIAL_WINDOW:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.output_text = ""
        self.stop_checked_upto = 0  # index into output_text already searched for stops
        self._special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self._rust = _rust_decoder(tokenizer)

    def _decode(self, ids: list[int]) -> str:
        if self.skip_special:
            ids = [i for i in ids if i not in self._special]
        if self._rust is not None:
            return self._rust.decode(ids, skip_special_tokens=False)
        return self.tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def add_tokens(self, new_ids: list[int]) -> str:
        """Append tokens; returns the newly complete text."""
        if not self.params.detokenize:
            return ""
        delta = ""
        for tid in new_ids:
            self.token_ids.append(tid)
            prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.token_ids[self.prefix_offset:])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                piece = full[len(prefix):]
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.token_ids)
                delta += piece
        self.output_text += delta
        return delta

    def check_stop(self) -> str | None:
        """Look for a stop string in the new text; truncate the output at it. Returns the stop string."""
        stops = self.params.stop
        if not stops:
            return None
        start = max(0, self.stop_checked_upto - self.params.max_stop_str_len + 1)
        text = self.output_text
        best: tuple[int, str] | None = None
        for s in stops:  # type: ignore[union-attr]
            i = text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        self.stop_checked_upto = len(text)
        if best is None:
            return None
        i, s = best
        self.output_text = text[: i + len(s)] if self.params.include_stop_str_in_output else text[:i]
        return s
