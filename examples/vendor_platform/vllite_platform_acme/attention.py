"""Acme's paged attention. A real vendor launches its own kernels here; this one is plain torch on the CPU.

The contract (``vllite_core.attention.backend``): write each new token's K/V at
its slot (slot < 0 is a padding token: skip it), then return causal attention
of every query over its request's context, read through the block table.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vllite_core.attention.backend import AttentionBackend, AttentionMetadata
from vllite_core.attention.kv_quant import dequantize, quantize


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors travel as bytes through index ops (which have no fp8 kernels on the CPU)."""
    return t.view(torch.uint8) if t.dtype.itemsize == 1 and t.dtype.is_floating_point else t


class AcmePagedAttention(AttentionBackend):
    """KV cache layout: the default ``(2, num_blocks, block_size, num_kv_heads, head_size)``."""

    name = "acme_paged"

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float, sliding_window: int | None = None,
                k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        md = metadata
        n = md.num_actual_tokens
        kv_heads, head_size, bs = kv_cache.shape[3], kv_cache.shape[4], kv_cache.shape[2]
        slots = md.slot_mapping[:n]
        real = slots >= 0
        for cache, new, s in ((kv_cache[0], key, k_scale), (kv_cache[1], value, v_scale)):
            flat = _bytes(cache.view(-1, kv_heads, head_size))
            flat.index_copy_(0, slots[real], _bytes(quantize(new[:n][real], cache.dtype, s)))  # fp8: / s, saturated
        out = torch.zeros_like(query)
        for r in range(md.num_reqs):
            start, end = md.query_start_loc_cpu[r], md.query_start_loc_cpu[r + 1]
            seq_len, q_len = md.seq_lens_cpu[r], end - start
            if q_len == 0:
                continue
            blocks = md.block_table[r, : -(-seq_len // bs)].long()
            k = dequantize(_bytes(kv_cache[0]).index_select(0, blocks).view(kv_cache.dtype), query.dtype, k_scale)
            v = dequantize(_bytes(kv_cache[1]).index_select(0, blocks).view(kv_cache.dtype), query.dtype, v_scale)
            k, v = k.flatten(0, 1)[:seq_len], v.flatten(0, 1)[:seq_len]  # [seq_len, kv_heads, head_size]
            q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
            k_pos = torch.arange(seq_len)[None, :]
            mask = k_pos <= q_pos
            if sliding_window is not None:
                mask &= k_pos > q_pos - sliding_window
            o = F.scaled_dot_product_attention(query[start:end].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                               attn_mask=mask, scale=scale, enable_gqa=query.shape[1] != kv_heads)
            out[start:end] = o.transpose(0, 1)
        return out
