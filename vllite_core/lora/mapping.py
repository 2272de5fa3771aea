"""Which adapter slot each token of a step uses, in the form every LoRA layer's op reads.

Built once per step by the runner (never per layer): the adapted tokens' indices grouped by slot
(``order``) with each active slot's segment of it, so a layer's ``ModelOps.lora_add`` runs one shrink
and one expand per segment (or one fused kernel over all of them) instead of a loop over requests.
Host lists serve the torch path and the CPU kernel; the per-slot ``seg_start`` / ``seg_len`` tensors
(fixed size ``max_loras``) serve device kernels, whose grid then does not depend on the step.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class LoRAMapping:
    num_tokens: int
    order: torch.Tensor  # int64 [n]: the adapted tokens' indices, grouped by slot (ascending), in step order
    identity: bool  # order is 0..num_tokens-1: every token adapted and already grouped (no gather needed)
    slots: list[int]  # the active slots, ascending
    starts: list[int]  # len(slots) + 1: slot slots[i]'s tokens are order[starts[i]:starts[i + 1]]
    seg_start: torch.Tensor  # int32 [max_loras]: each slot's first position in ``order`` (0 when inactive)
    seg_len: torch.Tensor  # int32 [max_loras]: its token count (0 when inactive)

    @property
    def segments(self) -> list[tuple[int, int, int]]:
        """(slot, start, end) over ``order``."""
        return list(zip(self.slots, self.starts[:-1], self.starts[1:]))


def build_mapping(token_slots: np.ndarray, max_loras: int, device: torch.device | str) -> LoRAMapping | None:
    """From each token's slot (-1: the base model); None when no token is adapted."""
    token_slots = np.asarray(token_slots, dtype=np.int64)
    adapted = np.nonzero(token_slots >= 0)[0]
    if len(adapted) == 0:
        return None
    order = adapted[np.argsort(token_slots[adapted], kind="stable")]
    sorted_slots = token_slots[order]
    slots, first, counts = np.unique(sorted_slots, return_index=True, return_counts=True)
    seg_start = np.zeros(max_loras, dtype=np.int32)
    seg_len = np.zeros(max_loras, dtype=np.int32)
    seg_start[slots] = first
    seg_len[slots] = counts
    identity = len(order) == len(token_slots) and bool((order == np.arange(len(order))).all())
    return LoRAMapping(
        num_tokens=len(token_slots), order=torch.as_tensor(order, device=device), identity=identity,
        slots=slots.tolist(), starts=[*first.tolist(), len(order)],
        seg_start=torch.as_tensor(seg_start, device=device), seg_len=torch.as_tensor(seg_len, device=device))
