"""Fused mixture-of-experts kernels for ``TritonModelOps.fused_moe``: two launches per layer over tokens sorted
by expert.

The T x k (token, slot) choices are sorted by expert (``order``; expert ``e`` owns sorted positions
``start[e] : start[e] + count[e]``). The grid is (row tiles, output tiles, experts): a program takes one tile of
one expert's sorted rows and multiplies it by that expert's weights with ``tl.dot``; programs past their
expert's row count exit at once, so an expert no token chose is never read, and every output row is written
by exactly one program (no atomics). The grid depends only on T x k and the expert count (no host sync).

gate_up: ``h[p] = silu(x[tok] @ W1_e.T) * (x[tok] @ W3_e.T)`` for sorted position p (token ``order[p] // k``),
rounded to the activations' dtype as the torch default rounds its SiLU-and-mul.
down: ``y[order[p]] = weight[order[p]] * (h[p] @ W2_e.T)``, into the (token, slot) row; the k slots of a token
are then summed.
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


@triton.jit(do_not_specialize=["hidden", "inter"])
def moe_gate_up_kernel(
    x_ptr, w13_ptr, h_ptr, order_ptr, start_ptr, count_ptr, hidden, inter,
    stride_xt, stride_we, stride_wn, stride_ht,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.program_id(2)
    n = tl.load(count_ptr + e)
    if pid_m * BLOCK_M >= n:
        return
    start = tl.load(start_ptr + e)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < n
    tok = (tl.load(order_ptr + start + offs_m, mask=m_ok, other=0) // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    w_base = w13_ptr + e.to(tl.int64) * stride_we
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < hidden
        x = tl.load(x_ptr + tok[:, None] * stride_xt + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)
        wmask = n_ok[None, :] & k_ok[:, None]
        wg = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None], mask=wmask, other=0.0)
        wu = tl.load(w_base + (inter + offs_n)[None, :] * stride_wn + offs_k[:, None], mask=wmask, other=0.0)
        gate += _dot(x, wg, IEEE)
        up += _dot(x, wu, IEEE)
    dt = h_ptr.dtype.element_ty
    g = gate.to(dt).to(tl.float32)
    u = up.to(dt).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    dst = h_ptr + (start + offs_m).to(tl.int64)[:, None] * stride_ht + offs_n[None, :]
    tl.store(dst, (s * u).to(dt), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["hidden", "inter"])
def moe_down_kernel(
    h_ptr, w2_ptr, y_ptr, weight_ptr, order_ptr, start_ptr, count_ptr, hidden, inter,
    stride_ht, stride_we, stride_wn, stride_yt,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.program_id(2)
    n = tl.load(count_ptr + e)
    if pid_m * BLOCK_M >= n:
        return
    start = tl.load(start_ptr + e)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < n
    dest = tl.load(order_ptr + start + offs_m, mask=m_ok, other=0).to(tl.int64)  # the (token, slot) row
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    w_base = w2_ptr + e.to(tl.int64) * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < inter
        h = tl.load(h_ptr + (start + offs_m).to(tl.int64)[:, None] * stride_ht + offs_k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None], mask=n_ok[None, :] & k_ok[:, None],
                    other=0.0)
        acc += _dot(h, w, IEEE)
    dt = y_ptr.dtype.element_ty
    wt = tl.load(weight_ptr + dest, mask=m_ok, other=0.0).to(tl.float32)
    out = acc.to(dt).to(tl.float32) * wt[:, None]
    tl.store(y_ptr + dest[:, None] * stride_yt + offs_n[None, :], out.to(dt), mask=m_ok[:, None] & n_ok[None, :])
