"""What a speculative-decoding proposer is to the model runner."""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Proposer(Protocol):
    """Drafts tokens from the requests' histories; called once per step for the rows that sampled."""

    num_speculative_tokens: int

    def propose(self, token_ids: np.ndarray, num_tokens: np.ndarray) -> list[list[int]]:
        """``token_ids`` [B, L] int64, row i valid up to ``num_tokens[i]`` (prompt + accepted outputs).
        Returns up to ``num_speculative_tokens`` drafts per row (an empty list: no guess)."""
