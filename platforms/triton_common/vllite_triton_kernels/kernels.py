"""The Triton kernels: write new K/V into the paged cache, and paged attention.

Cache layout (the core's default): one tensor per layer shaped
``(2, num_blocks, block_size, num_kv_heads, head_size)``; K is ``[0]``, V is
``[1]``. Token ``pos`` of a request lives at block ``block_table[req, pos //
block_size]``, offset ``pos % block_size``.

A float8 cache holds K / k_scale and V / v_scale (per layer, per tensor): the store kernel divides and
saturates, the attention kernel gets ``scale * k_scale`` as its score scale and multiplies the output
by ``v_scale``.

``paged_attention_kernel`` is one kernel for prefill, chunked prefill, decode
and any mix of them in a batch. A program owns one KV head and a tile of
``BLOCK_Q`` consecutive query tokens of one request, i.e. ``BLOCK_M = BLOCK_Q *
queries_per_kv`` rows (every query head that shares that KV head: GQA costs one
K/V read for the whole group). It walks the request's context in tiles of
``TILE_N`` token positions, each position looked up through the block table
(so a tile may span several pages and the page size is free), with an online
softmax in float32. Programs are numbered over the requests' query tiles:
request ``r`` owns programs ``[qsl[r] // BLOCK_Q + r, qsl[r+1] // BLOCK_Q + r + 1)``
(``qsl`` = query_start_loc), which needs nothing from the host; a program
finds its request by binary search. The grid is therefore fixed by the token
and request counts alone, which keeps CUDA-graph replay valid; extra programs
exit at once.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _to_cache(x, scale, FP8_MAX: tl.constexpr):
    """A float8 cache (FP8_MAX > 0, the format's largest finite value) stores x / scale saturated."""
    if FP8_MAX > 0:
        y = x.to(tl.float32) / scale
        return tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    else:
        return x


@triton.jit(do_not_specialize=["num_tokens", "k_scale", "v_scale"])
def store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, num_tokens, k_scale, v_scale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, HD_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_T: tl.constexpr, FP8_MAX: tl.constexpr,
):
    """BLOCK_T new tokens per program: cache[slot] = key/value (cast to the cache dtype; a float8 cache
    holds key / k_scale and value / v_scale, saturated); slot < 0 is padding."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = tok < num_tokens
    slot = tl.load(slot_ptr + tok, mask=tok_ok, other=-1).to(tl.int64)
    idx = tl.arange(0, HD_P)  # (head, dim) flattened
    h = idx // HEAD_SIZE
    d = idx % HEAD_SIZE
    mask = (slot >= 0)[:, None] & (idx < NUM_KV_HEADS * HEAD_SIZE)[None, :]
    dst = ((slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs)[:, None] + (h * stride_ch + d)[None, :]
    rows = tok.to(tl.int64)[:, None]
    k = tl.load(key_ptr + rows * stride_kt + (h * stride_kh + d)[None, :], mask=mask, other=0.0)
    tl.store(k_cache_ptr + dst, _to_cache(k, k_scale, FP8_MAX).to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(value_ptr + rows * stride_vt + (h * stride_vh + d)[None, :], mask=mask, other=0.0)
    tl.store(v_cache_ptr + dst, _to_cache(v, v_scale, FP8_MAX).to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _request_of_program(query_start_loc_ptr, num_reqs, pid, BLOCK_Q: tl.constexpr):
    """The last request r with qsl[r] // BLOCK_Q + r <= pid (binary search; may be num_reqs - 1 for spares)."""
    lo = num_reqs * 0  # int32 tensors from the start: loop-carried values keep one type
    hi = num_reqs + 0
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:  # float32 inputs: true fp32 products, not TF32
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit(do_not_specialize=["scale", "v_scale", "num_reqs"])
def paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale, v_scale, num_reqs,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    QUERIES_PER_KV: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr, IEEE: tl.constexpr, SOFT_CAP: tl.constexpr = 0.0,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = _request_of_program(query_start_loc_ptr, num_reqs, pid, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_tile = pid - (q_start // BLOCK_Q + req)
    if q_tile * BLOCK_Q >= q_len:  # a spare program (or an empty request)
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context = seq_len - q_len  # tokens cached before this step's queries

    offs_m = tl.arange(0, BLOCK_M)
    q_tok = q_tile * BLOCK_Q + offs_m // QUERIES_PER_KV  # query index within the request
    head = kv_head * QUERIES_PER_KV + offs_m % QUERIES_PER_KV
    row_ok = (offs_m // QUERIES_PER_KV < BLOCK_Q) & (q_tok < q_len)
    offs_d = tl.arange(0, HEAD_P)
    d_ok = offs_d < HEAD_SIZE
    rows = (q_start + q_tok).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = context + q_tok  # absolute position of each row's query token

    # Key positions this tile of queries can see: [lo, hi).
    hi = tl.minimum(seq_len, context + (q_tile + 1) * BLOCK_Q)
    lo = 0
    if SLIDING_WINDOW > 0:
        lo = tl.maximum(context + q_tile * BLOCK_Q - SLIDING_WINDOW + 1, 0)
        lo = (lo // TILE_N) * TILE_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_P], tl.float32)
    offs_n = tl.arange(0, TILE_N)
    for start in range(lo, hi, TILE_N):
        pos = start + offs_n
        pos_ok = pos < hi
        blk = tl.load(block_table_ptr + req * stride_bt + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        base = blk * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        k = tl.load(k_cache_ptr + base[None, :] + offs_d[:, None], mask=pos_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(v_cache_ptr + base[:, None] + offs_d[None, :], mask=pos_ok[:, None] & d_ok[None, :], other=0.0)
        s = _dot(q, k.to(q.dtype), IEEE) * scale  # [BLOCK_M, TILE_N], float32
        if SOFT_CAP > 0:  # Gemma 2: cap * tanh(s / cap), tanh written with the portable sigmoid
            s = SOFT_CAP * (2.0 * tl.sigmoid(2.0 * s / SOFT_CAP) - 1.0)
        keep = row_ok[:, None] & pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        if SLIDING_WINDOW > 0:
            keep = keep & (pos[None, :] > q_pos[:, None] - SLIDING_WINDOW)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet stay at zero weight
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v.to(q.dtype), IEEE)
        m_i = m_new

    out = acc * (v_scale / tl.where(l_i == 0.0, 1.0, l_i))[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
