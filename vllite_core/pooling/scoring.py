"""Scoring text pairs (``LLM.score``, ``/score``, ``/rerank``): a cross-encoder reads each pair as one
prompt (segment A, segment B: the tokenizer's pair encoding, token types included); an embedding model
embeds both sides and scores their cosine similarity."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from vllite_core.errors import InvalidRequestError
from vllite_core.pooling.token_types import encode_token_types


def score_pairs(data_1: str | list[str], data_2: str | list[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one query against N documents, or N against N."""
    left = [data_1] if isinstance(data_1, str) else list(data_1)
    right = [data_2] if isinstance(data_2, str) else list(data_2)
    for name, side in (("text_1", left), ("text_2", right)):
        if not side:
            raise InvalidRequestError(name, "must not be empty")
        if not all(isinstance(t, str) for t in side):
            raise InvalidRequestError(name, "must be a string or a list of strings")
    if len(left) == 1:
        left = left * len(right)
    if len(left) != len(right):
        raise InvalidRequestError("text_2", f"{len(left)} queries need 1 or {len(left)} documents, got {len(right)}")
    return list(zip(left, right))


def pair_prompt(tokenizer: Any, text_1: str, text_2: str) -> dict:
    """A cross-encoder's prompt for one pair: its ids, with the token types in their high bits."""
    enc = tokenizer(text_1, text_2)
    return {"prompt_token_ids": encode_token_types(list(enc["input_ids"]), enc.get("token_type_ids")),
            "prompt": None}


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.float()[None], b.float()[None])[0])
