"""Applying a packed token bitmask to logits with plain torch ops (any device, no per-token loop)."""
from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [n, words] -> bool [n, vocab_size]: bit t % 32 of word t // 32 is token t."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    allowed = bits.reshape(bitmask.shape[0], -1).bool()
    if allowed.shape[1] < vocab_size:  # tokens past the mask's width are never allowed
        pad = torch.zeros(allowed.shape[0], vocab_size - allowed.shape[1], dtype=torch.bool, device=allowed.device)
        allowed = torch.cat([allowed, pad], dim=1)
    return allowed[:, :vocab_size]


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Logits with every token the bitmask forbids set to -inf in ``rows`` (ascending, distinct); other
    rows are untouched. When every row is structured the rows are all of them, in order: no gather."""
    allowed = unpack_bitmask(bitmask, logits.shape[-1])
    if rows.numel() == logits.shape[0]:
        return logits.masked_fill(~allowed, _NEG_INF)
    return logits.index_put((rows,), logits[rows].masked_fill(~allowed, _NEG_INF))
