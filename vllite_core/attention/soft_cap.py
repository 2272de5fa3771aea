"""Attention logit soft-capping (Gemma 2): each scaled score ``s`` becomes ``cap * tanh(s / cap)`` before the mask and
the softmax. SDPA has no such option, so the torch paths that need it compute the scores themselves here."""
from __future__ import annotations

import torch


def soft_cap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(scores / cap)`` (transformers' order: divide, tanh, multiply); the scores as they are without a
    cap."""
    return scores if not cap else torch.tanh(scores / cap) * cap


def capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                     cap: float, is_causal: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention``'s contract (q ``[..., H, Tq, D]``, k/v ``[..., Hkv, L, D]`` with H a
    multiple of Hkv, a boolean ``mask`` that keeps True; ``is_causal`` aligns the causal mask to the end) with
    soft-capped scores, computed in float32 as transformers' eager attention does."""
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = soft_cap(torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale, cap)
    if is_causal:
        tq, length = q.shape[-2], k.shape[-2]
        mask = torch.ones(tq, length, dtype=torch.bool, device=q.device).tril(length - tq)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v.float()).to(q.dtype)
