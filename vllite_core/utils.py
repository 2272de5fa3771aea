"""Small arithmetic shared across the core (one definition each)."""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division: the blocks that ``a`` tokens need at ``b`` tokens per block."""
    return -(-a // b)
