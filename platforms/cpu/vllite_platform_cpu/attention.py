"""Paged attention for the CPU platform: the C++ kernel (``kernels.py``) when it is built, else PyTorch.

With the kernel, every query row of the step (decode, prefill, chunked prefill) is computed straight
from the paged cache in one call per layer: measured against SDPA for one prompt (SmolLM2's 9/3 heads,
one layer) it took 1.2 vs 2.6 ms at 128 tokens, 36 vs 81 ms at 1024 (SDPA's flash path, K/V heads
repeated) and 0.6 vs 1.4 s at 4096. Without it:
decode-only requests (one query token each) run as one batch: their context
blocks are gathered through the block table into a padded [B, L] tensor, the
tail past each sequence masked, and a single SDPA call covers all of them.
Requests with several query tokens (prefill, chunked prefill, speculative
verification) go one by one through SDPA with a causal mask aligned to the end
of their context. The per-step plan (which rows, which blocks, the masks) is
built once in ``prepare`` and shared by every layer. Gathers use
``index_select``/``index_copy_`` rather than advanced indexing, which on small
CPU tensors can stall milliseconds waking OpenMP threads.
"""
from __future__ import annotations

import mmap
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from vllite_core.attention.backend import AttentionBackend, AttentionMetadata
from vllite_core.attention.kv_quant import dequantize, is_fp8, store_scaled
from vllite_core.attention.soft_cap import capped_attention, soft_cap
from vllite_platform_cpu import kernels as _kernels


@dataclass
class _Prefill:
    rows: slice  # query rows of this request
    seq_len: int
    blocks: torch.Tensor  # long [ceil(seq_len / block_size)]


@dataclass
class _Plan:
    """What every layer of one step needs, computed once."""

    num_tokens: int
    decode_rows: torch.Tensor | None  # long [B]: the query row of each decode request
    decode_blocks: torch.Tensor | None  # long [B, nb]
    decode_seq_lens: torch.Tensor | None  # long [B]
    prefills: list[_Prefill]
    pure_decode: bool = False  # every query row is a decode row, in order: no row gather/scatter
    # For the C++ kernel (int32, contiguous): the step's index tensors and every request with query rows.
    kernel_args: tuple[torch.Tensor, ...] | None = None
    write_rows: torch.Tensor | None = None  # rows whose K/V are stored, when some slots are -1 (padding)
    slots: torch.Tensor | None = None  # the cache slots of the rows stored (the step's slot_mapping, padding dropped)
    kernel_slots: torch.Tensor | None = None  # int64 slot of each row for the kernel's store (-1: padding)
    masks: dict[tuple[object, int | None], torch.Tensor | None] = field(default_factory=dict)


class TorchPagedAttention(AttentionBackend):
    """PyTorch SDPA over a paged KV cache laid out as ``(2, num_blocks, block_size, num_kv_heads, head_size)``."""

    name = "torch_paged"
    supports_logits_soft_cap = True

    def allocate_kv_cache(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Zeroed by the OS on first touch instead of written at start: on the VMs measured here the first
        write to fresh memory runs at 0.25-0.45 GB/s, so ``torch.zeros`` of the default 4 GiB cache took 9-16 s
        of start-up. Untouched memory costs nothing until used (with huge pages: in steps of 2 MiB)."""
        if device.type != "cpu":
            return super().allocate_kv_cache(shape, dtype, device)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        return zeroed_huge_pages(nbytes).view(dtype).view(shape)

    def prepare(self, metadata: AttentionMetadata) -> None:
        metadata.extra = self._plan(metadata)

    def _plan(self, md: AttentionMetadata) -> _Plan:
        bs = md.block_size
        starts, seq_lens = md.query_start_loc_cpu, md.seq_lens_cpu
        decode_idx: list[int] = []
        prefill_idx: list[int] = []
        prefills: list[_Prefill] = []
        block_table = md.block_table.long()
        for i, seq_len in enumerate(seq_lens):
            q_len = starts[i + 1] - starts[i]
            if q_len == 0:
                continue
            if q_len == 1:
                decode_idx.append(i)
            else:
                prefill_idx.append(i)
                prefills.append(_Prefill(slice(starts[i], starts[i + 1]), seq_len, block_table[i, :-(-seq_len // bs)]))
        plan = _Plan(md.num_actual_tokens, None, None, None, prefills)
        slots = md.slot_mapping[:md.num_actual_tokens]
        plan.kernel_slots = slots.to(torch.long).contiguous()
        if slots.numel() and int(slots.min()) < 0:
            plan.write_rows = torch.nonzero(slots >= 0).flatten()
            slots = slots[plan.write_rows]
        plan.slots = slots
        if _kernels.available() and (decode_idx or prefill_idx):
            i32 = torch.int32
            plan.kernel_args = (md.block_table.to(i32).contiguous(), md.seq_lens.to(i32).contiguous(),
                                md.query_start_loc.to(i32).contiguous(),
                                torch.tensor(decode_idx + prefill_idx, dtype=i32, device=md.block_table.device))
        if decode_idx:
            device = md.block_table.device
            idx = torch.tensor(decode_idx, dtype=torch.long, device=device)
            width = -(-max(seq_lens[i] for i in decode_idx) // bs)
            plan.decode_rows = torch.tensor([starts[i] for i in decode_idx], dtype=torch.long, device=device)
            plan.decode_blocks = block_table[:, :width].index_select(0, idx)
            plan.decode_seq_lens = md.seq_lens.to(device=device, dtype=torch.long).index_select(0, idx)
            plan.pure_decode = not prefills and len(decode_idx) == len(seq_lens) and starts[-1] == len(decode_idx)
        return plan

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
        cap = logits_soft_cap or None
        plan = metadata.extra
        if not isinstance(plan, _Plan):
            plan = self._plan(metadata)
            if metadata.extra is None:
                metadata.extra = plan  # later layers of this step reuse it
        n = plan.num_tokens
        out = torch.zeros_like(query) if n < query.shape[0] else torch.empty_like(query)
        if kv_cache is None or kv_cache.numel() == 0:  # no cache yet (e.g. a profile run): context = new tokens
            return self._without_cache(query, key, value, metadata, out, scale, sliding_window, cap)
        if (plan.kernel_args is not None and kv_cache.dtype == query.dtype and k_scale == 1.0 and v_scale == 1.0
                and query.stride(-1) == key.stride(-1) == value.stride(-1) == 1):  # store + attention: one call
            _kernels.paged_attention_store(out, query, key, value, kv_cache, plan.kernel_slots, *plan.kernel_args,
                                           scale, sliding_window or 0, cap or 0.0)
            return out
        key_cache, value_cache = kv_cache.unbind(0)
        new_k, new_v = key, value
        if plan.write_rows is not None:  # padded rows (slot -1) write nowhere
            new_k, new_v = key.index_select(0, plan.write_rows), value.index_select(0, plan.write_rows)
        elif n < key.shape[0]:
            new_k, new_v = key[:n], value[:n]
        hkv, d = key.shape[1], key.shape[2]
        store_scaled(key_cache.view(-1, hkv, d), plan.slots, new_k, k_scale)
        store_scaled(value_cache.view(-1, hkv, d), plan.slots, new_v, v_scale)
        if plan.kernel_args is not None and _kernel_reads(kv_cache.dtype, query.dtype) and query.stride(-1) == 1:
            _kernels.paged_attention(out, query, key_cache, value_cache, *plan.kernel_args, scale,
                                     sliding_window or 0, k_scale, v_scale, cap or 0.0)
            return out
        if plan.decode_rows is not None:
            dec = self._decode(query, kv_cache, plan, scale, sliding_window, k_scale, v_scale, cap)
            if plan.pure_decode:
                out[:dec.shape[0]] = dec
            else:
                out.index_copy_(0, plan.decode_rows, dec)
        for p in plan.prefills:
            q = query[p.rows]
            if p.seq_len == q.shape[0] and kv_cache.dtype == q.dtype:  # no cached prefix: K/V are the new rows
                k, v = key[p.rows], value[p.rows]
            else:
                k = _gather(kv_cache[0], p.blocks, q.dtype, k_scale).flatten(0, 1)[:p.seq_len]
                v = _gather(kv_cache[1], p.blocks, q.dtype, v_scale).flatten(0, 1)[:p.seq_len]
            out[p.rows] = self._prefill(q, k, v, plan.masks, p.rows.start, scale, sliding_window, cap)
        return out

    def _without_cache(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, md: AttentionMetadata,
                       out: torch.Tensor, scale: float, window: int | None, cap: float | None) -> torch.Tensor:
        starts = md.query_start_loc_cpu
        masks: dict[tuple[object, int | None], torch.Tensor | None] = {}
        for i in range(md.num_reqs):
            rows = slice(starts[i], starts[i + 1])
            if rows.stop > rows.start:
                out[rows] = self._prefill(query[rows], key[rows], value[rows], masks, i, scale, window, cap)
        return out

    def _decode(self, query: torch.Tensor, kv_cache: torch.Tensor, plan: _Plan, scale: float,
                window: int | None, k_scale: float = 1.0, v_scale: float = 1.0,
                cap: float | None = None) -> torch.Tensor:
        """One query token per request, all requests at once, with two batched matmuls.

        SDPA's CPU kernel is slow for a single query row (it splits and allocates per call:
        milliseconds per layer at batch 1), so decode is written out: the context blocks are
        gathered head-major, ``[Hkv, B, L, D]`` (one copy straight from the cache's
        ``[blocks, block, Hkv, D]`` layout), the ``G = H / Hkv`` query heads sharing a KV head
        go in one matmul row block, the tail past each sequence is masked with a bias shared
        by every layer of the step, then softmax and the second matmul."""
        assert plan.decode_rows is not None and plan.decode_blocks is not None
        b, nb = plan.decode_blocks.shape
        bs, hkv, d = kv_cache.shape[2], kv_cache.shape[3], kv_cache.shape[4]
        h = query.shape[1]
        g = h // hkv
        length = nb * bs
        q = query[:b] if plan.pure_decode else query.index_select(0, plan.decode_rows)
        work = torch.float32 if query.dtype != torch.float64 else query.dtype
        # [B, H, D] -> [Hkv, B, G, D] -> [Hkv*B, G, D]
        q = q.view(b, hkv, g, d).transpose(0, 1).reshape(hkv * b, g, d).to(work)
        blocks = plan.decode_blocks.reshape(-1)
        k = _gather_heads(kv_cache[0], blocks, work, k_scale).view(hkv * b, length, d)
        v = _gather_heads(kv_cache[1], blocks, work, v_scale).view(hkv * b, length, d)
        bias = plan.masks.get(("decode", window))
        if bias is None:
            assert plan.decode_seq_lens is not None
            pos = torch.arange(length, device=q.device)
            seq = plan.decode_seq_lens[:, None]
            keep = pos[None, :] < seq
            if window is not None:
                keep &= pos[None, :] >= seq - window  # the query sits at seq - 1
            bias = torch.zeros(b, length, dtype=work, device=q.device).masked_fill_(~keep, float("-inf"))
            bias = plan.masks[("decode", window)] = bias.view(1, b, 1, length)
        scores = torch.bmm(q, k.transpose(1, 2)).view(hkv, b, g, length)
        scores.mul_(scale)
        if cap:
            scores = soft_cap(scores, cap)
        scores.add_(bias)
        probs = torch.softmax(scores, dim=-1).view(hkv * b, g, length)
        out = torch.bmm(probs, v).view(hkv, b, g, d).transpose(0, 1).reshape(b, h, d)
        return out.to(query.dtype)

    @staticmethod
    def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 masks: dict[tuple[object, int | None], torch.Tensor | None], req: object, scale: float,
                 window: int | None, cap: float | None = None) -> torch.Tensor:
        """Causal attention of q (the last q_len positions of the context) over k/v ([L, heads, D])."""
        q_len, seq_len = q.shape[0], k.shape[0]
        key = (req, window)
        if key not in masks:
            if q_len == seq_len and window is None:
                masks[key] = None  # plain causal: let SDPA use its fused path
            else:
                q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
                k_pos = torch.arange(seq_len, device=q.device)[None, :]
                keep = k_pos <= q_pos
                if window is not None:
                    keep &= k_pos > q_pos - window
                masks[key] = keep
        mask = masks[key]
        if cap:
            return capped_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask, scale, cap,
                                    is_causal=mask is None).transpose(0, 1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, is_causal=mask is None,
            scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(0, 1)


_KERNEL_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
HUGE_PAGE = 2 << 20


def zeroed_huge_pages(nbytes: int) -> torch.Tensor:
    """``nbytes`` of zeros (uint8) from anonymous memory, zeroed by the OS on first touch, 2 MiB-aligned and
    advised for transparent huge pages where the OS has them (Linux; its usual THP mode, ``madvise``, backs
    only memory that asks). Why: a decode step's attention reads every request's blocks from all over each
    layer's cache, hundreds of MB per step; on 4 KiB pages that is a TLB miss and a page walk for nearly every
    block, the walks' page-table reads competing with the blocks for memory. With 2 MiB pages a batch-64 bf16
    decode step of SmolLM2 took 45.4-45.7 against 47.6-48.5 ms of model time (``benchmarks/step_times.py``,
    Zen 4). Elsewhere: numpy's ``calloc``, also zeroed on first touch."""
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8))
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel built without THP: 4 KiB pages, as calloc's
        pass
    whole = torch.frombuffer(buf, dtype=torch.uint8)  # holds a reference to buf: unmapped with the last view
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def _kernel_reads(cache_dtype: torch.dtype, query_dtype: torch.dtype) -> bool:
    """The C++ kernel reads caches in the query's dtype, and float8 ones under a float32 / bfloat16 query."""
    return cache_dtype == query_dtype or (cache_dtype in _KERNEL_FP8 and query_dtype in (torch.float32,
                                                                                       torch.bfloat16))


def _gather_heads(cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Blocks of one cache half ``[num_blocks, bs, Hkv, D]`` gathered head-major: ``[Hkv, len(blocks) * bs, D]``.

    A dim-0 ``index_select`` then one transposing copy: ``index_select`` over a permuted
    view takes a generic strided path that is ~100x slower on the CPU."""
    hkv, d = cache.shape[2], cache.shape[3]
    rows = _gather(cache, blocks, dtype, scale).view(-1, hkv, d)
    return rows.transpose(0, 1).contiguous()


def _gather(cache: torch.Tensor, index: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """cache[index] in ``dtype`` (a float8 cache's values times ``scale``)."""
    if is_fp8(cache.dtype):
        return dequantize(cache.view(torch.uint8).index_select(0, index).view(cache.dtype), dtype, scale)
    return cache.index_select(0, index).to(dtype)
