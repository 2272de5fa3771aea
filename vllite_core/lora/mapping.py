"""Which adapter slot each token of a step uses, in the form every LoRA layer's op reads.

Built once per step by the runner (never per layer): the adapted tokens' indices grouped by slot
(``order``) with each active slot's segment of it, so a layer's ``ModelOps.lora_add`` runs one shrink
and one expand per segment (or one fused kernel over all of them) instead of a loop over requests.
Host lists serve the torch path and the CPU kernel; the per-slot ``seg_start`` / ``seg_len`` tensors
(fixed size ``max_loras``) serve device kernels, whose grid then does not depend on the step.

A captured decode graph reads a ``static`` mapping instead: buffers made once per captured batch size
and refilled in place before every replay (``fill_static``); only its device tensors are current, so
only ops that read nothing else (``ModelOps.lora_graph_safe``) may run under a graph.
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
    static: bool = False  # a captured graph's buffers: order has num_tokens entries, host lists are not current

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


def static_mapping(num_tokens: int, max_loras: int, device: torch.device | str) -> LoRAMapping:
    """The buffers a decode graph of ``num_tokens`` rows is captured with (no row adapted until filled)."""
    return LoRAMapping(
        num_tokens=num_tokens, order=torch.zeros(num_tokens, dtype=torch.int64, device=device), identity=False,
        slots=list(range(max_loras)), starts=[], seg_start=torch.zeros(max_loras, dtype=torch.int32, device=device),
        seg_len=torch.zeros(max_loras, dtype=torch.int32, device=device), static=True)


def fill_static(dst: LoRAMapping, src: LoRAMapping | None) -> None:
    """Write the step's mapping (``src``; None: no adapted row) into a graph's buffers, in place."""
    if src is None:
        dst.seg_len.zero_()
        return
    dst.order[:src.order.shape[0]].copy_(src.order, non_blocking=True)
    dst.seg_start.copy_(src.seg_start, non_blocking=True)
    dst.seg_len.copy_(src.seg_len, non_blocking=True)
