"""A classifier head made from language-model head rows (vLLM's ``classifier_from_token``): a causal LM that
answers with chosen tokens, such as Qwen3-Reranker's "no" / "yes", served as a sequence classifier.

``is_original_qwen3_reranker`` (or ``method`` "from_2_way_softmax") with two tokens [false, true]: one label
whose weight is row(true) - row(false), so the score's sigmoid equals the softmax over the two tokens' logits
at the last prompt token; otherwise ("no_post_processing") one label per token, each its own row."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllite_core.errors import ConfigError

TWO_WAY = "from_2_way_softmax"
PLAIN = "no_post_processing"


@dataclass(frozen=True)
class TokenClassifier:
    token_ids: tuple[int, ...]
    method: str

    @property
    def num_labels(self) -> int:
        return 1 if self.method == TWO_WAY else len(self.token_ids)

    def head(self, rows: torch.Tensor) -> torch.Tensor:
        """The score weight [num_labels, hidden] from the LM head's rows of ``token_ids`` (in that order)."""
        return (rows[1] - rows[0])[None] if self.method == TWO_WAY else rows


def token_classifier(hf_config: Any) -> TokenClassifier | None:
    """What ``resolve_classifier_tokens`` put on the config; None: an ordinary head from the checkpoint."""
    ids = getattr(hf_config, "classifier_token_ids", None)
    return None if ids is None else TokenClassifier(tuple(ids), str(hf_config.method))


def resolve_classifier_tokens(hf_config: Any, tokenizer: Any) -> None:
    """Turn ``classifier_from_token`` (token strings) into ids with the model's tokenizer and set the label
    count; the model's ``load_weights`` then builds its head from those LM-head rows. ConfigError names the
    option for a token the vocabulary lacks or a two-way head without two tokens."""
    tokens = getattr(hf_config, "classifier_from_token", None)
    if tokens is None:
        return
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ConfigError("hf_overrides.classifier_from_token: must be a non-empty list of token strings")
    two_way = bool(getattr(hf_config, "is_original_qwen3_reranker", False)) \
        or getattr(hf_config, "method", None) == TWO_WAY
    if two_way and len(tokens) != 2:
        raise ConfigError(f"hf_overrides.classifier_from_token: a two-way softmax head takes two tokens "
                          f"[false, true], got {len(tokens)}")
    vocab = tokenizer.get_vocab()
    missing = [t for t in tokens if t not in vocab]
    if missing:
        raise ConfigError(f"hf_overrides.classifier_from_token: {', '.join(map(repr, missing))} is not one token "
                          "of the model's vocabulary")
    hf_config.classifier_token_ids = [int(vocab[t]) for t in tokens]
    hf_config.method = TWO_WAY if two_way else PLAIN
    hf_config.num_labels = 1 if two_way else len(tokens)
