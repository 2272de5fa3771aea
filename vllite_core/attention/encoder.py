"""Bidirectional attention over a step's packed prompts (encoder models: BERT): every token attends to every
token of its own prompt, nothing is cached. ``PackedPrompts`` is built once per step from the metadata's host
copies and shared by every layer; ``ModelOps.encoder_attention`` takes it (a platform may run its own kernel
on the packed rows; the torch default below pads the prompts into buckets for SDPA)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


class PackedPrompts:
    """Prompt ``b`` is rows ``[cu[b], cu[b + 1])`` of the step's tokens."""

    BUCKET = 16  # prompts per padded SDPA call (torch path)

    def __init__(self, query_start_loc_cpu: list[int], device: torch.device) -> None:
        self.starts = list(query_start_loc_cpu)
        self.cu_seqlens = torch.tensor(self.starts, dtype=torch.long)  # host copy, for kernels that loop on it
        self.device = device
        self._buckets: list | None = None

    def buckets(self) -> list[tuple[int, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]]:
        """The prompts sorted by length, cut into buckets of similar lengths, each padded to its own longest
        and masked (little padding, few SDPA calls); built on first use."""
        if self._buckets is None:
            qsl, device = self.starts, self.device
            spans = sorted(((b - a, a) for a, b in zip(qsl[:-1], qsl[1:]) if b > a), reverse=True)
            self._buckets = []
            for i in range(0, len(spans), self.BUCKET):
                group = spans[i:i + self.BUCKET]
                longest = group[0][0]
                # Padding rows repeat the prompt's first token (masked out as keys, dropped as queries).
                gather = torch.tensor([[start + min(j, n - 1) for j in range(longest)] for n, start in group])
                valid = torch.tensor([[j < n for j in range(longest)] for n, _ in group])
                uniform = bool(valid.all())
                mask = None if uniform else valid[:, None, None, :].to(device)
                rows = None if uniform else valid.view(-1).nonzero().view(-1).to(device)
                dest = torch.cat([torch.arange(start, start + n) for n, start in group]).to(device)
                self._buckets.append((len(group), gather.view(-1).to(device), mask, rows, dest))
        return self._buckets


def padded_attention(qkv: torch.Tensor, prompts: PackedPrompts, scale: float) -> torch.Tensor:
    """[T, 3, heads, head_size] -> [T, heads, head_size] through torch's SDPA, bucket by bucket."""
    out = torch.empty(qkv.shape[0], *qkv.shape[2:], dtype=qkv.dtype, device=qkv.device)
    for num_reqs, gather, mask, rows, dest in prompts.buckets():
        padded = qkv.index_select(0, gather).view(num_reqs, -1, *qkv.shape[1:])  # [B, L, 3, H, D]
        q, k, v = (padded[:, :, i].transpose(1, 2) for i in range(3))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(1, 2)
        o = o.reshape(-1, *qkv.shape[2:])
        out[dest] = o if rows is None else o.index_select(0, rows)
    return out
