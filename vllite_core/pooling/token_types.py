"""Token type ids (BERT's segment A / B of a text pair) ride in the high bits of the prompt's token ids,
so a cross-encoder's pair needs no extra field through the scheduler and the runner; the model splits
them again. Different types give different ids, so the prefix cache keeps them apart too."""
from __future__ import annotations

import torch

TOKEN_TYPE_SHIFT = 30
_ID_MASK = (1 << TOKEN_TYPE_SHIFT) - 1


def encode_token_types(token_ids: list[int], token_type_ids: list[int] | None) -> list[int]:
    if not token_type_ids:
        return list(token_ids)
    return [t | (tt << TOKEN_TYPE_SHIFT) for t, tt in zip(token_ids, token_type_ids, strict=True)]


def plain_token_id(token_id: int) -> int:
    return token_id & _ID_MASK


def token_type(token_id: int) -> int:
    return token_id >> TOKEN_TYPE_SHIFT


def split_token_types(input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, token type ids) of a step's flattened ids."""
    return input_ids & _ID_MASK, input_ids >> TOKEN_TYPE_SHIFT
