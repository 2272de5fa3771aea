"""What a platform's attention backend receives and must do.

Tokens of all requests in a step are flattened into one sequence (no padding
across requests). Request ``i`` owns query rows
``query_start_loc[i]:query_start_loc[i+1]``; those rows are the *last*
``query_len`` positions of a context of ``seq_lens[i]`` tokens, whose K/V live
in the paged cache at the blocks listed in ``block_table[i]``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from vllite_core.attention.kv_quant import store_scaled
from vllite_core.attention.spans import NonCausalSpans, span_mask
from vllite_core.utils import cdiv


@dataclass
class AttentionMetadata:
    """Built once per step by the model runner, shared by every layer."""

    num_actual_tokens: int
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1], cumulative query lengths
    seq_lens: torch.Tensor  # int32 [num_reqs], context length after this step's tokens
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks_per_req]; unused entries are 0
    slot_mapping: torch.Tensor  # int64 [num_tokens], block_id * block_size + offset for each new token
    max_query_len: int
    max_seq_len: int
    block_size: int
    # Host copies, so backends can plan without device syncs.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # Backend-specific extras, from AttentionBackend.prepare().
    extra: Any = None
    # Query rows that also see the keys after them up to their span's end (set by the model: Gemma 3's images).
    noncausal_spans: NonCausalSpans | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend(ABC):
    """Paged attention for one platform. Stateless apart from what prepare() caches per step."""

    name: str = "abstract"
    # True when forward() reads only the metadata's tensors (never its host copies or a per-step plan from
    # prepare()) and launches work whose shapes depend on tensor shapes alone: a captured device graph
    # replayed with new tensor contents then computes the right answer.
    supports_graph_capture: bool = False
    # True when forward() takes ``logits_soft_cap`` (Gemma 2's attention); a model that needs it refuses a
    # backend without it at build time (ConfigError), and the conformance kit skips its soft-cap cases.
    supports_logits_soft_cap: bool = False

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """Shape of one layer's KV cache tensor. Default: K and V stacked on dim 0."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def allocate_kv_cache(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zero-filled cache tensor. A platform whose memory can be handed out zeroed on first touch
        overrides this so that start-up does not write the whole budget."""
        return torch.zeros(shape, dtype=dtype, device=device)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Store K/V rows at their slots (default layout). Used for encoder outputs of
        encoder-decoder models; self-attention writes inside forward()."""
        store_scaled(kv_cache[0].view(-1, *kv_cache.shape[-2:]), slot_mapping, key)
        store_scaled(kv_cache[1].view(-1, *kv_cache.shape[-2:]), slot_mapping, value)

    def forward_cross(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                      scale: float) -> torch.Tensor:
        """Cross-attention: each request's queries attend, without a causal mask, to all
        ``metadata.seq_lens[i]`` encoder positions stored at ``metadata.block_table[i]``.
        ``metadata.query_start_loc`` splits the query rows. A torch default for the default layout."""
        bs = kv_cache.shape[2]
        out = torch.empty_like(query)
        qsl = metadata.query_start_loc_cpu
        for i, enc_len in enumerate(metadata.seq_lens_cpu):
            q0, q1 = qsl[i], qsl[i + 1]
            if q1 == q0:
                continue
            nb = cdiv(enc_len, bs)
            blocks = metadata.block_table[i, :nb].long()
            k = kv_cache[0].index_select(0, blocks).reshape(-1, *kv_cache.shape[-2:])[:enc_len]
            v = kv_cache[1].index_select(0, blocks).reshape(-1, *kv_cache.shape[-2:])[:enc_len]
            q = query[q0:q1].transpose(0, 1)  # [H, Tq, D]
            k, v = k.transpose(0, 1).to(q.dtype), v.transpose(0, 1).to(q.dtype)
            o = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, scale=scale, enable_gqa=q.shape[0] != k.shape[0])
            out[q0:q1] = o.transpose(0, 1)
        return out

    def forward_spans(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                      scale: float, sliding_window: int | None = None, k_scale: float = 1.0,
                      v_scale: float = 1.0) -> torch.Tensor:
        """The outputs of ``metadata.noncausal_spans``' rows (in ``spans.rows`` order), after ``forward`` wrote
        the step's K/V: each row attends to its request's keys before its span's end, within the window. A
        torch default for the default layout."""
        spans = metadata.noncausal_spans
        assert spans is not None
        bs = kv_cache.shape[2]
        outs = []
        for sp in spans.spans:
            lo = 0 if sliding_window is None else max(0, sp.first_pos - sliding_window + 1)
            b0, b1 = lo // bs, cdiv(sp.end, bs)
            blocks = metadata.block_table[sp.req, b0:b1].long()
            k = kv_cache[0].index_select(0, blocks).reshape(-1, *kv_cache.shape[-2:])[lo - b0 * bs:sp.end - b0 * bs]
            v = kv_cache[1].index_select(0, blocks).reshape(-1, *kv_cache.shape[-2:])[lo - b0 * bs:sp.end - b0 * bs]
            q = query[sp.rows[0]:sp.rows[1]].transpose(0, 1)  # [H, Tq, D]
            k, v = k.transpose(0, 1).to(q.dtype), v.transpose(0, 1).to(q.dtype)
            if k_scale != 1.0 or v_scale != 1.0:
                k, v = k * k_scale, v * v_scale
            mask = span_mask(sp, lo, sliding_window, q.device)
            o = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[0] != k.shape[0])
            outs.append(o.transpose(0, 1))
        return torch.cat(outs)

    def prepare(self, metadata: AttentionMetadata) -> None:
        """Called once per step after the runner builds the metadata; may set ``metadata.extra``."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # get_kv_cache_shape(...)
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """Write key/value into the cache at ``slot_mapping``, then return causal attention
        of each query over its request's context: [num_tokens, num_heads, head_size].
        ``logits_soft_cap`` (Gemma 2): each scaled score s is ``cap * tanh(s / cap)`` before the
        softmax; models pass it only when set (``vllite_core.attention.soft_cap``).

        A float8 cache stores ``key / k_scale`` and ``value / v_scale`` saturated to the format's range
        (``kv_quant.quantize``) and attention reads them multiplied back. Models pass the scales only
        when they are not 1.0 (a backend of a platform without float8 caches never sees them)."""
