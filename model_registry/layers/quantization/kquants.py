"""GGUF K-quants (Q4_K, Q5_K, Q6_K) as ``GGUFWeight`` records the CPU kernel computes from (csrc/gguf.cpp).

A K-quant row is super-blocks of 256 weights. GGUF's blocks (``gguf.quants`` reads them the same way):
- Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes holding 8 six-bit scales ``sc`` and 8 six-bit minimums ``m``
  (one per 32 weights), 128 bytes of nibbles; weight = (d * sc) * q - (dmin * m), q in 0..15;
- Q5_K (176 bytes): as Q4_K plus 32 bytes of fifth bits before the nibbles; q in 0..31;
- Q6_K (210 bytes): 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales (one per 16 weights),
  fp16 d; weight = (d * sc) * (q - 32), q in 0..63.

The repacked record (8 output rows x one super-block, the layout csrc/gguf.cpp documents) keeps the same
integers: the values' low nibbles in 32-byte chunks (byte 4r + i of chunk 8jj + c: row r's weights
64jj + 4c + i and 64jj + 32 + 4c + i), their high bits in 32-byte vectors a shift apart, the scales and
minimums unpacked to one byte each, then the rows' fp16 d (and dmin). Bytes per record: Q4_K 1184 (GGUF
1152: the 6-bit scales as bytes, +2.8%), Q5_K 1440 (1408, +2.3%), Q6_K 1680 (the same).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from model_registry.layers.quantization.gguf import GGUF_GROUP, GGUF_RECORD, KQ_BLOCK, KQUANTS, GGUFWeight
from vllite_core.errors import ConfigError

BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}  # GGUF's bytes per super-block


@dataclass(frozen=True)
class KQuantFields:
    """One K-quant tensor [N, K] as integers: ``q`` uint8 [N, K] (0..15 / 31 / 63), ``sc`` [N, K / 32] uint8
    (Q6_K: [N, K / 16] int8), ``mn`` [N, K / 32] uint8 (None for Q6_K), ``d`` / ``dmin`` float16 [N, K / 256]
    (dmin None for Q6_K)."""

    qtype: str
    q: np.ndarray
    sc: np.ndarray
    mn: np.ndarray | None
    d: np.ndarray
    dmin: np.ndarray | None


def _scales_mins(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 minimums: j < 4 in the low 6 bits of bytes j and 4 + j;
    j >= 4 in byte 4 + j's low (scale) and high (minimum) nibble plus the top 2 bits of bytes j - 4 and j."""
    s = s.astype(np.uint8)
    lo_sc, lo_mn, mix = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate((lo_sc & 63, (mix & 15) | ((lo_sc >> 6) << 4)), axis=-1)
    mn = np.concatenate((lo_mn & 63, (mix >> 4) | ((lo_mn >> 6) << 4)), axis=-1)
    return sc, mn


def decode_blocks(raw: np.ndarray, qtype: str) -> KQuantFields:
    """GGUF blocks ``raw`` uint8 [N, K / 256 * block bytes] -> ``KQuantFields``."""
    if qtype not in KQUANTS:
        raise ConfigError(f"gguf: {qtype} is not a K-quant this kernel computes ({', '.join(KQUANTS)})")
    n = raw.shape[0]
    blk = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, -1, BLOCK_BYTES[qtype])
    nsb = blk.shape[1]

    def f16(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a).view(np.float16).reshape(n, nsb)

    if qtype == "Q6_K":
        ql = blk[..., 0:128].reshape(n, nsb, 2, 1, 64)
        qh = blk[..., 128:192].reshape(n, nsb, 2, 1, 32)
        low = np.concatenate((ql & 15, ql >> 4), axis=3).reshape(n, nsb, 256)
        high = ((qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 3).reshape(n, nsb, 256)
        q = (low | (high << 4)).reshape(n, -1)
        sc = np.ascontiguousarray(blk[..., 192:208]).view(np.int8).reshape(n, -1)
        return KQuantFields(qtype, q, sc, None, f16(blk[..., 208:210]), None)
    sc, mn = _scales_mins(blk[..., 4:16])
    qs = blk[..., -128:].reshape(n, nsb, 4, 1, 32)
    q = np.concatenate((qs & 15, qs >> 4), axis=3).reshape(n, nsb, 256)
    if qtype == "Q5_K":
        qh = blk[..., 16:48].reshape(n, nsb, 1, 32)
        q = q | (((qh >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1) << 4).reshape(n, nsb, 256)
    return KQuantFields(qtype, q.reshape(n, -1), sc.reshape(n, -1), mn.reshape(n, -1), f16(blk[..., 0:2]),
                        f16(blk[..., 2:4]))


def pack_kquant(f: KQuantFields) -> GGUFWeight:
    """The record layout of csrc/gguf.cpp from the fields (rows past N in the last group are zeros)."""
    n, k = f.q.shape
    if k % KQ_BLOCK:
        raise ConfigError(f"gguf: a {f.qtype} tensor needs rows of a multiple of {KQ_BLOCK} weights, got {k}")
    nsb, g = k // KQ_BLOCK, -(-n // GGUF_GROUP)

    def grouped(a: np.ndarray) -> np.ndarray:  # [N, ...] -> [g, 8, ...] with zero rows
        a = np.ascontiguousarray(a)
        pad = np.zeros((g * GGUF_GROUP - n, *a.shape[1:]), dtype=a.dtype)
        return np.concatenate((a, pad)).reshape(g, GGUF_GROUP, *a.shape[1:])

    q = grouped(f.q).reshape(g, GGUF_GROUP, nsb, 4, 2, 8, 4)  # [g, r, s, jj, h, c, i]
    nib = (q[:, :, :, :, 0] & 15) | ((q[:, :, :, :, 1] & 15) << 4)  # [g, r, s, jj, c, i]
    parts = [nib.transpose(0, 2, 3, 4, 1, 5).reshape(g, nsb, 1024)]
    if f.qtype == "Q5_K":
        bits = ((q >> 4) & 1).astype(np.uint32) << np.arange(8, dtype=np.uint32).reshape(8, 1)
        h = bits.sum(axis=5).astype(np.uint8)  # [g, r, s, jj, h, i]
        parts.append(h.transpose(0, 2, 3, 4, 1, 5).reshape(g, nsb, 256))
    elif f.qtype == "Q6_K":
        pairs = ((q >> 4) & 3).reshape(g, GGUF_GROUP, nsb, 4, 2, 2, 4, 4).astype(np.uint32)  # c = 4u + c'
        h = (pairs << (2 * np.arange(4, dtype=np.uint32)).reshape(4, 1)).sum(axis=6).astype(np.uint8)
        parts.append(h.transpose(0, 2, 3, 4, 5, 1, 6).reshape(g, nsb, 512))  # [g, s, jj, h, u, r, i]
    nsub = f.sc.shape[1] // nsb
    for a in (f.sc, f.mn):
        if a is not None:
            parts.append(grouped(a.view(np.uint8)).reshape(g, GGUF_GROUP, nsb, nsub).transpose(0, 2, 3, 1)
                         .reshape(g, nsb, nsub * GGUF_GROUP))
    for a in (f.d, f.dmin):
        if a is not None:
            halves = grouped(a.astype(np.float16)).transpose(0, 2, 1)  # [g, s, r]
            parts.append(np.ascontiguousarray(halves).view(np.uint8).reshape(g, nsb, 2 * GGUF_GROUP))
    rec = np.concatenate(parts, axis=2)
    assert rec.shape[2] == GGUF_RECORD[f.qtype], (f.qtype, rec.shape)
    return GGUFWeight(f.qtype, torch.from_numpy(np.ascontiguousarray(rec.reshape(g, -1))), n)


def unpack_kquant(w: GGUFWeight) -> KQuantFields:
    """``pack_kquant``'s inverse."""
    n, k = w.shape
    nsb, g = k // KQ_BLOCK, w.blocks.shape[0]
    rec = w.blocks.numpy().reshape(g, nsb, GGUF_RECORD[w.qtype])
    nib = rec[:, :, :1024].reshape(g, nsb, 4, 8, GGUF_GROUP, 4).transpose(0, 4, 1, 2, 3, 5)  # [g, r, s, jj, c, i]
    q = np.stack((nib & 15, nib >> 4), axis=4)  # [g, r, s, jj, h, c, i]
    at = 1024
    if w.qtype == "Q5_K":
        h = rec[:, :, at:at + 256].reshape(g, nsb, 4, 2, GGUF_GROUP, 4).transpose(0, 4, 1, 2, 3, 5)
        q = q | (((h[:, :, :, :, :, None] >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1) << 4)
        at += 256
    elif w.qtype == "Q6_K":
        h = rec[:, :, at:at + 512].reshape(g, nsb, 4, 2, 2, GGUF_GROUP, 4).transpose(0, 5, 1, 2, 3, 4, 6)
        hi = (h[:, :, :, :, :, :, None] >> (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)) & 3
        q = q | (hi.reshape(g, GGUF_GROUP, nsb, 4, 2, 8, 4) << 4)
        at += 512
    q = q.reshape(g * GGUF_GROUP, k)[:n]
    nsub = 16 if w.qtype == "Q6_K" else 8

    def bytes_(at: int) -> np.ndarray:
        a = rec[:, :, at:at + nsub * GGUF_GROUP].reshape(g, nsb, nsub, GGUF_GROUP).transpose(0, 3, 1, 2)
        return np.ascontiguousarray(a).reshape(g * GGUF_GROUP, nsb * nsub)[:n]

    def halves(at: int) -> np.ndarray:
        a = np.ascontiguousarray(rec[:, :, at:at + 2 * GGUF_GROUP]).view(np.float16).reshape(g, nsb, GGUF_GROUP)
        return np.ascontiguousarray(a.transpose(0, 2, 1)).reshape(g * GGUF_GROUP, nsb)[:n]

    sc = bytes_(at)
    at += nsub * GGUF_GROUP
    if w.qtype == "Q6_K":
        return KQuantFields(w.qtype, q, sc.view(np.int8), None, halves(at), None)
    mn = bytes_(at)
    at += nsub * GGUF_GROUP
    return KQuantFields(w.qtype, q, sc, mn, halves(at), halves(at + 2 * GGUF_GROUP))


def dequantize_fields(f: KQuantFields) -> torch.Tensor:
    """float32 [N, K]: gguf.quants' arithmetic in float32 (d * sc first, then times q, minus dmin * m)."""
    n, k = f.q.shape
    nsub = f.sc.shape[1] // (k // KQ_BLOCK)
    d = torch.from_numpy(f.d.astype(np.float32)).repeat_interleave(nsub, dim=1)
    ds = (d * torch.from_numpy(f.sc.astype(np.float32)))[:, :, None]
    q = torch.from_numpy(f.q.astype(np.float32)).view(n, -1, k // f.sc.shape[1])
    if f.qtype == "Q6_K":
        return (ds * (q - 32.0)).reshape(n, k)
    dm = torch.from_numpy(f.dmin.astype(np.float32)).repeat_interleave(nsub, dim=1)
    dm = (dm * torch.from_numpy(f.mn.astype(np.float32)))[:, :, None]
    return (ds * q - dm).reshape(n, k)


def dequantize_kquant(w: GGUFWeight) -> torch.Tensor:
    return dequantize_fields(unpack_kquant(w))


def repack_kquant(raw: np.ndarray, qtype: str) -> GGUFWeight:
    """GGUF K-quant blocks [N, K / 256 * block bytes] as a ``GGUFWeight``: by the platform's kernel where it has
    one (``ModelOps.gguf_repack``), else here a few hundred rows at a time (whole groups of 8), so numpy's
    intermediate arrays stay in the cache (Llama-1B's Q4_K_M tensors: 2.5-4.0 s -> 1.2 s for twelve of them, the
    same records)."""
    from vllite_core.model_ops import current_model_ops

    if qtype not in KQUANTS:
        raise ConfigError(f"gguf: {qtype} is not a K-quant this kernel computes ({', '.join(KQUANTS)})")
    n, k = raw.shape[0], raw.shape[1] // BLOCK_BYTES[qtype] * KQ_BLOCK
    if raw.shape[1] % BLOCK_BYTES[qtype] == 0:  # else decode_blocks names the bad shape
        with warnings.catch_warnings():  # the file's read-only pages, which the kernel only reads
            warnings.simplefilter("ignore", UserWarning)
            src = torch.from_numpy(np.ascontiguousarray(raw, dtype=np.uint8))
        blocks = current_model_ops().gguf_repack(src, qtype)
        if blocks is not None:
            return GGUFWeight(qtype, blocks, n)
    rows = max(GGUF_GROUP, (1 << 19) // max(k, 1) // GGUF_GROUP * GGUF_GROUP)
    if n <= rows:
        return pack_kquant(decode_blocks(raw, qtype))
    parts = [pack_kquant(decode_blocks(raw[i:i + rows], qtype)).blocks for i in range(0, n, rows)]
    return GGUFWeight(qtype, torch.cat(parts), n)
