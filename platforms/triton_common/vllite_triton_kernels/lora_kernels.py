"""Multi-LoRA shrink and expand kernels (the segmented "sgmv" pair) over a step's adapted rows.

The rows are grouped by adapter slot (``vllite_core.lora.mapping``): ``order`` lists the adapted rows'
indices, slot ``s`` owns ``order[seg_start[s] : seg_start[s] + seg_len[s]]``. The grid is (row tiles,
[output tiles,] slots): a program takes one tile of one slot's rows, so each tile multiplies by that
slot's matrices with ``tl.dot`` and every row is written by exactly one program (no atomics). Programs
past their slot's row count exit at once; the grid depends only on the row count and ``max_loras``.

shrink: ``h[p] = x[order[p]] @ A_s[:rank].T`` (float32, into a [rows, rank] buffer in ``order``'s order).
expand: ``y[order[p]] += h[p] @ B_s[:rank]`` with B stored transposed ([slots, R, out]).
Ranks past a slot's own are zero in the stacked tensors, so one ``rank`` (the step's largest) serves all.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:  # float32 inputs: true fp32 products, not TF32
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit(do_not_specialize=["in_features", "rank"])
def lora_shrink_kernel(
    x_ptr, a_ptr, h_ptr, order_ptr, seg_start_ptr, seg_len_ptr, in_features, rank,
    stride_xt, stride_as, stride_ar, stride_ht,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, R_P: tl.constexpr, IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    slot = tl.program_id(1)
    n = tl.load(seg_len_ptr + slot)
    if pid_m * BLOCK_M >= n:
        return
    start = tl.load(seg_start_ptr + slot)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < n
    rows = tl.load(order_ptr + start + offs_m, mask=m_ok, other=0).to(tl.int64)
    offs_r = tl.arange(0, R_P)
    r_ok = offs_r < rank
    a_base = a_ptr + slot.to(tl.int64) * stride_as
    acc = tl.zeros([BLOCK_M, R_P], tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < in_features
        x = tl.load(x_ptr + rows[:, None] * stride_xt + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)
        a = tl.load(a_base + offs_r[None, :] * stride_ar + offs_k[:, None], mask=r_ok[None, :] & k_ok[:, None],
                    other=0.0)  # [BLOCK_K, R_P]: A_s transposed
        acc += _dot(x, a.to(x.dtype), IEEE)
    dst = h_ptr + (start + offs_m).to(tl.int64)[:, None] * stride_ht + offs_r[None, :]
    tl.store(dst, acc, mask=m_ok[:, None] & r_ok[None, :])


@triton.jit(do_not_specialize=["out_features", "rank"])
def lora_expand_kernel(
    h_ptr, b_ptr, y_ptr, order_ptr, seg_start_ptr, seg_len_ptr, out_features, rank,
    stride_ht, stride_bs, stride_br, stride_yt,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, R_P: tl.constexpr, IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.program_id(2)
    n = tl.load(seg_len_ptr + slot)
    if pid_m * BLOCK_M >= n:
        return
    start = tl.load(seg_start_ptr + slot)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < n
    rows = tl.load(order_ptr + start + offs_m, mask=m_ok, other=0).to(tl.int64)
    offs_r = tl.arange(0, R_P)
    r_ok = offs_r < rank
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < out_features
    h = tl.load(h_ptr + (start + offs_m).to(tl.int64)[:, None] * stride_ht + offs_r[None, :],
                mask=m_ok[:, None] & r_ok[None, :], other=0.0)
    b = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + offs_r[:, None] * stride_br + offs_n[None, :],
                mask=r_ok[:, None] & n_ok[None, :], other=0.0)  # [R_P, BLOCK_N]
    delta = _dot(h.to(b.dtype), b, IEEE)
    mask = m_ok[:, None] & n_ok[None, :]
    y_at = y_ptr + rows[:, None] * stride_yt + offs_n[None, :]
    y = tl.load(y_at, mask=mask, other=0.0)
    tl.store(y_at, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=mask)
