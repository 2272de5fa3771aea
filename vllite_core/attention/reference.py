"""A deliberately simple paged attention, the yardstick for real backends.

One request and one query token at a time, explicit float32 softmax, no
batching tricks: slow, but easy to check by eye. Tests and the platform
conformance kit compare every backend against it. ``build_metadata`` makes the
``AttentionMetadata`` a model runner would, from per-request lengths and block
lists, so tests can drive backends and models without the engine.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from vllite_core.attention.backend import AttentionBackend, AttentionMetadata
from vllite_core.attention.soft_cap import soft_cap


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store each new token's key/value at its slot (``block_id * block_size + offset``)."""
    num_kv_heads, head_size = key.shape[1], key.shape[2]
    k_flat = kv_cache[0].view(-1, num_kv_heads, head_size)
    v_flat = kv_cache[1].view(-1, num_kv_heads, head_size)
    for t in range(key.shape[0]):
        slot = int(slot_mapping[t])
        if slot < 0:  # padding token
            continue
        k_flat[slot] = key[t].to(kv_cache.dtype)
        v_flat[slot] = value[t].to(kv_cache.dtype)


def reference_paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Write K/V into the cache, then attend each query token over its request's cached context (scores
    soft-capped when ``logits_soft_cap`` is set)."""
    n = metadata.num_actual_tokens
    write_kv(key[:n], value[:n], kv_cache, metadata.slot_mapping[:n])
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    bs = metadata.block_size
    out = torch.zeros_like(query)
    for r in range(metadata.num_reqs):
        q_start, q_end = metadata.query_start_loc_cpu[r], metadata.query_start_loc_cpu[r + 1]
        seq_len = metadata.seq_lens_cpu[r]
        q_len = q_end - q_start
        # Gather the request's context, token by token, from its blocks.
        ctx_k = torch.empty(seq_len, num_kv_heads, head_size, dtype=torch.float32)
        ctx_v = torch.empty_like(ctx_k)
        for pos in range(seq_len):
            block = int(metadata.block_table[r, pos // bs])
            ctx_k[pos] = kv_cache[0, block, pos % bs].float()
            ctx_v[pos] = kv_cache[1, block, pos % bs].float()
        for j in range(q_len):
            q_pos = seq_len - q_len + j  # absolute position of this query token
            lo = 0 if sliding_window is None else max(0, q_pos - sliding_window + 1)
            for h in range(num_heads):
                kv_h = h // group
                q = query[q_start + j, h].float()
                scores = soft_cap((ctx_k[lo:q_pos + 1, kv_h] @ q) * scale, logits_soft_cap)
                probs = torch.exp(scores - scores.max())
                probs = probs / probs.sum()
                out[q_start + j, h] = (probs @ ctx_v[lo:q_pos + 1, kv_h]).to(query.dtype)
    return out


class ReferenceAttention(AttentionBackend):
    """``reference_paged_attention`` as a backend (for conformance runs, never for speed)."""

    name = "reference"
    supports_logits_soft_cap = True

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float, sliding_window: int | None = None,
                logits_soft_cap: float | None = None) -> torch.Tensor:
        return reference_paged_attention(query, key, value, kv_cache, metadata, scale, sliding_window,
                                         logits_soft_cap)


def build_metadata(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Metadata for one step: request ``i`` adds ``query_lens[i]`` tokens, ending a context of ``seq_lens[i]``
    tokens stored in blocks ``block_tables[i]`` (in order)."""
    if not (len(query_lens) == len(seq_lens) == len(block_tables)):
        raise ValueError("query_lens, seq_lens and block_tables need one entry per request")
    starts = [0]
    slots: list[int] = []
    for q_len, seq_len, blocks in zip(query_lens, seq_lens, block_tables):
        if not 0 < q_len <= seq_len or len(blocks) * block_size < seq_len:
            raise ValueError(f"bad request: query_len={q_len}, seq_len={seq_len}, {len(blocks)} blocks")
        starts.append(starts[-1] + q_len)
        for pos in range(seq_len - q_len, seq_len):
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    width = max(len(b) for b in block_tables) if block_tables else 0
    table = torch.zeros(len(block_tables), width, dtype=torch.int32)
    for i, blocks in enumerate(block_tables):
        table[i, :len(blocks)] = torch.tensor(list(blocks), dtype=torch.int32)
    return AttentionMetadata(
        num_actual_tokens=starts[-1],
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
        block_table=table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        block_size=block_size,
        query_start_loc_cpu=starts,
        seq_lens_cpu=list(seq_lens),
    )
