"""Attention with sinks (gpt-oss): each head has a learned logit that joins every query's softmax as one more
"key" with no value, so a head can attend to nothing. The platform's backends have no such term, so this layer
keeps its own paged cache (``SinkAttentionSpec`` / ``SlidingSinkAttentionSpec``: ``[blocks, block_size,
2 * kv_heads * head_size]``, K then V per token) and computes attention with torch ops (any device). With a
sliding window a query sees its last ``sliding_window`` positions, itself included, and only the blocks
covering them are read (the group releases older ones).
"""
from __future__ import annotations

import torch
from torch import nn

from model_registry.layers.params import check_full, copy_checked, empty_param
from vllite_core.attention.backend import AttentionMetadata
from vllite_core.core.kv_cache_spec import KVCacheSpec, SinkAttentionSpec, SlidingSinkAttentionSpec
from vllite_core.errors import ConfigError


class SinkAttention(nn.Module):
    """Causal attention of ``num_heads`` query heads over ``num_kv_heads`` cached heads, plus ``sinks`` [H].
    Over tensor-parallel ranks the heads are this rank's: ``head_start`` is the first one's index among the
    checkpoint's ``total_heads`` sinks (loaded as that slice)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
                 sliding_window: int | None = None, scale: float | None = None, head_start: int = 0,
                 total_heads: int | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.sliding_window = sliding_window
        self.scale = head_size ** -0.5 if scale is None else scale
        self.sinks = empty_param(num_heads, dtype=dtype)
        self.head_start, self.total_heads = head_start, total_heads or num_heads
        self.sinks.weight_loader = self._load_sinks  # type: ignore[attr-defined]

    @torch.no_grad()
    def _load_sinks(self, param: torch.Tensor, src: torch.Tensor, shard: str | None, name: str) -> None:
        check_full(src, 0, self.total_heads, name)
        copy_checked(param.data, src[self.head_start:self.head_start + self.num_heads], name)

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        if dtype.itemsize == 1:
            raise ConfigError("kv_cache_dtype: attention with sinks (gpt-oss) keeps K/V in the model dtype; use "
                              "kv_cache_dtype='auto'")
        if self.sliding_window:
            return SlidingSinkAttentionSpec(block_size, self.num_kv_heads, self.head_size, dtype,
                                            sliding_window=self.sliding_window)
        return SinkAttentionSpec(block_size, self.num_kv_heads, self.head_size, dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                md: AttentionMetadata) -> torch.Tensor:
        """q [T, H, D], k and v [T, Hkv, D] (written to the cache first) -> [T, H, D]."""
        n, hkv, d = md.num_actual_tokens, self.num_kv_heads, self.head_size
        rows = kv_cache.view(-1, kv_cache.shape[-1])
        rows.index_copy_(0, md.slot_mapping[:n], torch.cat((k[:n].reshape(n, -1), v[:n].reshape(n, -1)), -1)
                         .to(kv_cache.dtype))
        out = torch.zeros_like(q)
        qsl, bs = md.query_start_loc_cpu, kv_cache.shape[1]
        group = self.num_heads // hkv
        for i, length in enumerate(md.seq_lens_cpu):
            q0, q1 = qsl[i], qsl[i + 1]
            if q1 == q0:
                continue
            tq = q1 - q0
            first = max(0, length - tq - self.sliding_window + 1) if self.sliding_window else 0
            b0, b1 = first // bs, (length + bs - 1) // bs  # only the blocks some query here can see
            ctx = kv_cache.index_select(0, md.block_table[i, b0:b1].long()).view(-1, 2, hkv, d)
            ctx = ctx[first - b0 * bs:length - b0 * bs].to(q.dtype)
            keys = ctx[:, 0].repeat_interleave(group, 1).transpose(0, 1)  # [H, L', D]
            values = ctx[:, 1].repeat_interleave(group, 1).transpose(0, 1)
            scores = (q[q0:q1].transpose(0, 1) @ keys.transpose(1, 2)) * self.scale  # [H, tq, L']
            pos_k = torch.arange(first, length, device=q.device)[None, :]
            pos_q = torch.arange(length - tq, length, device=q.device)[:, None]
            seen = pos_k <= pos_q
            if self.sliding_window:
                seen &= pos_k > pos_q - self.sliding_window
            scores = scores.masked_fill(~seen, float("-inf"))
            sink = self.sinks.to(scores.dtype).view(-1, 1, 1).expand(-1, tq, 1)
            logits = torch.cat((scores, sink), -1)
            probs = torch.softmax(logits - logits.amax(-1, keepdim=True), dim=-1)[..., :-1]
            out[q0:q1] = (probs @ values).transpose(0, 1)
        return out
