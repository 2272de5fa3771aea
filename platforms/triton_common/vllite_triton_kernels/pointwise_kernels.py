"""Fused pointwise kernels of a Llama-style layer for ``TritonModelOps``: RMSNorm (with the residual add),
SiLU-and-mul and the NeoX rotary embedding, one launch each.

Why: the torch defaults of ``vllite_core.model_ops.ModelOps`` are 3-10 kernels each (casts, pow, mean, rsqrt,
muls; chunk, silu, mul; cat, muls, add per tensor), so a batch-1 decode step of SmolLM2 replayed about 300
small kernels from its CUDA graph (2.4 ms on an H200, docs/platforms.md). Each kernel here rounds where the
torch default rounds (every op's result in the activations' dtype; float32 inside a norm), so the numbers
are the defaults' up to the GPU's own exp/rsqrt.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["eps"])
def rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n_cols, x_stride, res_stride, out_stride, eps,
                    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """One row per program: out = w * round(x / rms(x)); with a residual, first residual += x (rounded, and
    stored back) and the sum is what gets normalised."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(x.dtype)
        tl.store(res_ptr + row * res_stride + cols, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=0) / n_cols
    h = h * (1.0 / tl.sqrt(var + eps))
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = w.to(tl.float32) * h.to(x.dtype).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, y.to(x.dtype), mask=mask)


@triton.jit
def silu_and_mul_kernel(x_ptr, out_ptr, n, x_stride, out_stride, BLOCK: tl.constexpr):
    """out[r, c] = round(round(silu(x[r, c])) * x[r, n + c]); programs over (rows, column blocks)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    g = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * x_stride + n + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(out_ptr + row * out_stride + cols, (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)


@triton.jit
def rotary_kernel(x_ptr, cos_ptr, sin_ptr, heads, x_stride_t, x_stride_h, cs_stride, HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr):
    """In place, one token per program, all its heads: x = x * cos + rotate_half(x) * sin, each product and
    the sum rounded to x's dtype (the NeoX layout: the two halves of a head are paired)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HALF)[None, :]
    mask = h < heads
    base = x_ptr + t * x_stride_t + h * x_stride_h
    x1 = tl.load(base + d, mask=mask, other=0.0)
    x2 = tl.load(base + HALF + d, mask=mask, other=0.0)
    c1 = tl.load(cos_ptr + t * cs_stride + d).to(tl.float32)
    c2 = tl.load(cos_ptr + t * cs_stride + HALF + d).to(tl.float32)
    s1 = tl.load(sin_ptr + t * cs_stride + d).to(tl.float32)
    s2 = tl.load(sin_ptr + t * cs_stride + HALF + d).to(tl.float32)
    dt = x1.dtype
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    o1 = ((f1 * c1).to(dt).to(tl.float32) + (-f2 * s1).to(dt).to(tl.float32)).to(dt)
    o2 = ((f2 * c2).to(dt).to(tl.float32) + (f1 * s2).to(dt).to(tl.float32)).to(dt)
    tl.store(base + d, o1, mask=mask)
    tl.store(base + HALF + d, o2, mask=mask)
