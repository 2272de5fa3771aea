"""Paged attention through ``torch.nn.functional.scaled_dot_product_attention``, any torch device.

The portable fallback of the accelerator platforms (CUDA without Triton, XPU)
and the TPU's backend. Requests are laid out as a padded batch: queries
``[R, Qmax]``, context ``[R, L]`` gathered from the paged cache through the
block table, one boolean mask, one SDPA call for the whole step. Everything
data-dependent (which query row goes where, each row's position) is planned on
the host in ``prepare`` from the metadata's host copies, once per step, and
shipped as small index tensors; ``forward`` then runs only fixed-shape tensor
ops with no device-to-host sync. Given ``bucket`` (a function rounding a size
up), the padded sizes R, Qmax and the number of context blocks are bucketed so
XLA sees a handful of shapes instead of one per step.

Padding tokens (slot < 0) write their K/V into block 0, the null block the
engine's block pool never hands to a request; this keeps the write a single
fixed-shape ``index_copy_``.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from vllite_core.attention.backend import AttentionBackend, AttentionMetadata
from vllite_core.attention.kv_quant import dequantize, is_fp8, store_scaled
from vllite_core.attention.soft_cap import capped_attention
from vllite_core.utils import cdiv


def store_kv(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, scale: float = 1.0) -> None:
    """``cache`` viewed as [slots, heads, dim]: cache[slots] = x in the cache dtype (float8: x / scale,
    saturated); slot < 0 goes to slot 0. fp8 caches are written as bytes (index ops lack fp8 kernels on
    several devices)."""
    flat = cache.reshape(-1, x.shape[1], x.shape[2])
    slots = torch.where(slots < 0, torch.zeros_like(slots), slots)
    store_scaled(flat, slots, x, scale)


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """cache[blocks] ([num_blocks, block_size, heads, dim] -> [*blocks.shape, block_size, heads, dim]) in ``dtype``
    (a float8 cache's values times ``scale``)."""
    flat = blocks.reshape(-1)
    if is_fp8(cache.dtype):
        out = cache.view(torch.uint8).index_select(0, flat).view(cache.dtype)
    else:
        out = cache.index_select(0, flat)
    return dequantize(out, dtype, scale).view(*blocks.shape, *cache.shape[1:])


@dataclass
class SdpaPlan:
    """One step's layout, built by ``prepare`` and shared by every layer."""

    num_tokens: int  # rows of the flattened query this plan covers (padding included)
    num_reqs: int  # R after bucketing
    max_q: int  # Qmax after bucketing
    num_blocks: int  # context blocks per request after bucketing
    q_index: torch.Tensor  # long [R * Qmax]: the query row feeding each padded slot
    out_index: torch.Tensor  # long [num_tokens]: the padded slot each query row reads its output from
    q_pos: torch.Tensor  # long [R, Qmax]: absolute position of each padded query (-1: padding)
    seq_lens: torch.Tensor  # long [R]
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)


class SdpaPagedAttention(AttentionBackend):
    """Paged attention as one masked SDPA call per layer over a padded batch."""

    name = "sdpa_paged"
    supports_logits_soft_cap = True

    def __init__(self, bucket: Callable[[int], int] | None = None) -> None:
        self.bucket = bucket or (lambda n: n)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        store_kv(kv_cache[0], slot_mapping, key)
        store_kv(kv_cache[1], slot_mapping, value)

    def prepare(self, metadata: AttentionMetadata) -> None:
        metadata.extra = self.plan(metadata)

    def plan(self, md: AttentionMetadata) -> SdpaPlan:
        starts, seq_lens = md.query_start_loc_cpu, md.seq_lens_cpu
        num_reqs = len(seq_lens)
        num_tokens = max(int(md.slot_mapping.shape[0]), md.num_actual_tokens)
        q_lens = [starts[i + 1] - starts[i] for i in range(num_reqs)]
        r_pad = max(1, self.bucket(max(num_reqs, 1)))
        q_pad = max(1, self.bucket(max(q_lens, default=1)))
        nb = cdiv(max(seq_lens, default=1), md.block_size)
        nb_pad = max(1, self.bucket(max(nb, 1)))
        if r_pad < num_reqs or q_pad < max(q_lens, default=0) or nb_pad < nb:
            raise ValueError("bucket() must round sizes up, never down")
        q_index = [0] * (r_pad * q_pad)
        out_index = [0] * num_tokens
        q_pos = [[-1] * q_pad for _ in range(r_pad)]
        for r in range(num_reqs):
            for j in range(q_lens[r]):
                row = starts[r] + j
                q_index[r * q_pad + j] = row
                out_index[row] = r * q_pad + j
                q_pos[r][j] = seq_lens[r] - q_lens[r] + j
        dev = md.block_table.device
        return SdpaPlan(
            num_tokens=num_tokens, num_reqs=r_pad, max_q=q_pad, num_blocks=nb_pad,
            q_index=torch.tensor(q_index, dtype=torch.long, device=dev),
            out_index=torch.tensor(out_index, dtype=torch.long, device=dev),
            q_pos=torch.tensor(q_pos, dtype=torch.long, device=dev),
            seq_lens=torch.tensor(list(seq_lens) + [0] * (r_pad - num_reqs), dtype=torch.long, device=dev))

    def _mask(self, plan: SdpaPlan, block_size: int, window: int | None) -> torch.Tensor:
        if window not in plan.masks:
            k_pos = torch.arange(plan.num_blocks * block_size, device=plan.q_pos.device)[None, None, :]
            q_pos = plan.q_pos[:, :, None]
            keep = (k_pos <= q_pos) & (k_pos < plan.seq_lens[:, None, None])
            if window is not None:
                keep &= k_pos > q_pos - window
            # Padding rows attend to key 0 so no row is fully masked (SDPA would return NaN there).
            keep |= (q_pos < 0) & (k_pos == 0)
            plan.masks[window] = keep[:, None]  # [R, 1, Qmax, L], broadcast over heads
        return plan.masks[window]

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        plan = metadata.extra
        if not isinstance(plan, SdpaPlan):
            plan = self.plan(metadata)
            if metadata.extra is None:
                metadata.extra = plan
        n = min(key.shape[0], metadata.slot_mapping.shape[0])
        store_kv(kv_cache[0], metadata.slot_mapping[:n], key[:n], k_scale)
        store_kv(kv_cache[1], metadata.slot_mapping[:n], value[:n], v_scale)
        num_heads, head_size = query.shape[1], query.shape[2]
        num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
        r, qm, nb = plan.num_reqs, plan.max_q, plan.num_blocks
        table = metadata.block_table.long()
        table = F.pad(table[:, :nb], (0, max(0, nb - table.shape[1]), 0, max(0, r - table.shape[0])))
        k = gather_blocks(kv_cache[0], table, query.dtype, k_scale).view(r, nb * block_size, num_kv_heads, head_size)
        v = gather_blocks(kv_cache[1], table, query.dtype, v_scale).view(r, nb * block_size, num_kv_heads, head_size)
        q = query.index_select(0, plan.q_index).view(r, qm, num_heads, head_size)
        mask = self._mask(plan, block_size, sliding_window)
        if logits_soft_cap:
            out = capped_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, scale,
                                   logits_soft_cap)
        else:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale,
                enable_gqa=num_heads != num_kv_heads)
        out = out.transpose(1, 2).reshape(r * qm, num_heads, head_size).index_select(0, plan.out_index)
        if out.shape[0] < query.shape[0]:
            out = torch.cat([out, out.new_zeros(query.shape[0] - out.shape[0], num_heads, head_size)])
        return out[: query.shape[0]]
