"""The attention layer: computes attention over the paged KV cache through the platform's backend and declares
the cache it needs (``kv_cache_spec``), with its options (scale, sliding window) and float8 cache scales."""
from __future__ import annotations

import torch
from torch import nn

from vllite_core.attention.backend import AttentionBackend, AttentionMetadata
from vllite_core.attention.kv_quant import KVScales
from vllite_core.core.kv_cache_spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from vllite_core.errors import ConfigError


class Attention(nn.Module):
    """Causal self-attention of ``num_heads`` query heads over ``num_kv_heads`` cached K/V heads (this rank's);
    ``scale`` defaults to ``head_size ** -0.5``; ``sliding_window`` (tokens) limits what a query sees and lets the
    cache release blocks out of every future window; ``logits_soft_cap`` (Gemma 2's) bounds each scaled score
    ``s`` to ``cap * tanh(s / cap)`` before the softmax."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, backend: AttentionBackend,
                 scale: float | None = None, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.scale = head_size ** -0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap or None
        if self.logits_soft_cap and not backend.supports_logits_soft_cap:
            raise ConfigError(f"this model soft-caps its attention logits (logits_soft_cap={logits_soft_cap}); the "
                              f"attention backend {backend.name!r} does not support that")
        self.backend = backend
        self.kv_scales = KVScales()  # float8 caches only: the checkpoint's, 1.0, or the first batch's

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        """Full attention, or a sliding-window group whose blocks out of the window go back to the pool."""
        if self.sliding_window:
            return SlidingWindowSpec(block_size, self.num_kv_heads, self.head_size, dtype,
                                     sliding_window=self.sliding_window)
        return FullAttentionSpec(block_size, self.num_kv_heads, self.head_size, dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        """q [T, H, D], k and v [T, Hkv, D] -> [T, H, D]; k and v are written to the cache first. Rows of the
        metadata's non-causal spans (Gemma 3's images) are then recomputed seeing their whole span."""
        self.kv_scales.maybe_calculate(k, v, kv_cache)
        kwargs = self.kv_scales.kwargs()
        scaled = dict(kwargs)
        if self.logits_soft_cap:  # only when set: a backend without soft-capping never sees the argument
            kwargs["logits_soft_cap"] = self.logits_soft_cap
        out = self.backend.forward(q, k, v, kv_cache, metadata, self.scale, self.sliding_window, **kwargs)
        if metadata.noncausal_spans is not None:
            if self.logits_soft_cap:
                raise NotImplementedError("non-causal spans with soft-capped attention logits")
            rows = metadata.noncausal_spans.rows.to(out.device)
            out[rows] = self.backend.forward_spans(q, kv_cache, metadata, self.scale, self.sliding_window,
                                                   **scaled).to(out.dtype)
        return out
