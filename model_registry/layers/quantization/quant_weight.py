"""The one layout every pre-quantized linear weight is repacked into at load, and its reference arithmetic.

A ``QuantWeight`` is a weight [N, K] as codes with group-wise scales along K (``group`` input columns share a
scale per output row): int4 / int8 codes with a zero point (compressed-tensors W4A16 / W8A16, GPTQ, AWQ, int8
W8A8 static) or float8 e4m3 codes (``fp8``, compressed-tensors FP8; a 128x128 block scale is the same scale
for 128 rows of a group). Columns may be stored permuted (``perm``: GPTQ's ``desc_act`` / ``g_idx``), so that
every group is contiguous; the product then takes ``x[:, perm]``. 4-bit codes are packed two per byte
(column 2j in the low nibble, 2j + 1 in the high one).

``ActQuant`` says how the activations are quantized before the product (None: weight-only, A16), as the
checkpoint's producer does it: symmetric, ``scale = amax / qmax`` (int8: qmax = 127.5 as compressed-tensors
computes it, values clamped to [-128, 127]; fp8: 448) per token, per group of columns, or one static scale.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

FP8_MAX = 448.0  # largest float8 e4m3fn value


@dataclass(frozen=True)
class ActQuant:
    """How activations are quantized before the product: ``kind`` int8 or fp8, ``strategy`` token (dynamic per
    row), group (dynamic per row and ``group`` columns) or tensor (``scale``, static, from the checkpoint)."""

    kind: Literal["int8", "fp8"]
    strategy: Literal["token", "group", "tensor"]
    scale: torch.Tensor | None = None
    group: int | None = None


@dataclass(frozen=True)
class QuantWeight:
    """A weight [``rows``, ``cols``]: ``codes`` (uint8 [N, K / 2] two 4-bit codes a byte, uint8 [N, K] 8-bit
    unsigned codes, int8 [N, K] signed ones, or float8_e4m3fn [N, K]), ``scales`` float32 [N, ceil(K / group)],
    ``zeros`` ([N, groups] float32, the zero point in code units) or None for the symmetric zero ``zero``
    (2^(bits-1) for unsigned codes, 0 for signed and float codes); ``perm`` int64 [K] or None (stored column j
    is the checkpoint's column ``perm[j]``)."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    bits: int
    group: int
    rows: int
    cols: int
    zero: int = 0
    perm: torch.Tensor | None = None
    act: ActQuant | None = None

    @property
    def is_float(self) -> bool:
        return self.codes.dtype == torch.float8_e4m3fn

    def nbytes(self) -> int:
        n = self.codes.numel() * self.codes.element_size() + self.scales.numel() * 4
        return n + (0 if self.zeros is None else self.zeros.numel() * 4)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] in the stored (permuted) column order."""
        return dequantize(self)

    def reference(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W.T + bias`` by ``reference_linear``."""
        return reference_linear(x, self, bias)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] codes 0..15 -> uint8 [N, K / 2] (column 2j low nibble, 2j + 1 high)."""
    c = codes.to(torch.uint8)
    return (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """``pack_int4``'s inverse."""
    out = torch.stack((packed & 0x0F, packed >> 4), dim=2)
    return out.reshape(packed.shape[0], -1)


def codes_as_float(w: QuantWeight) -> torch.Tensor:
    """The codes [N, K] as float32 values (4-bit unpacked), zero point not yet taken off."""
    c = unpack_int4(w.codes) if w.bits == 4 else w.codes
    return c.float()


def dequantize(w: QuantWeight) -> torch.Tensor:
    """``(code - zero) * scale`` per group, float32 [N, K] (stored column order). Whole groups broadcast their
    scales (no gather: a 2048 x 8192 weight in tens of milliseconds, not seconds)."""
    v = codes_as_float(w)
    n, k = v.shape
    if k % w.group == 0:
        g = v.view(n, k // w.group, w.group)
        if w.zeros is not None:
            g.sub_(w.zeros[:, :, None])
        elif w.zero:
            g.sub_(float(w.zero))
        return g.mul_(w.scales[:, :, None]).view(n, k)
    idx = torch.arange(k) // w.group
    if w.zeros is not None:
        v = v - w.zeros[:, idx]
    elif w.zero:
        v = v - float(w.zero)
    return v * w.scales[:, idx]


def fake_quant(x: torch.Tensor, act: ActQuant) -> torch.Tensor:
    """``x`` (float32 [M, K]) quantized as ``act`` says and back: what the product sees."""
    qmax, lo, hi = (127.5, -128.0, 127.0) if act.kind == "int8" else (FP8_MAX, -FP8_MAX, FP8_MAX)
    if act.strategy == "tensor":
        assert act.scale is not None
        scale = act.scale.float().reshape(1, 1)
    elif act.strategy == "group":
        assert act.group is not None
        m, k = x.shape
        xg = x.reshape(m, k // act.group, act.group)
        scale = (xg.abs().amax(dim=-1, keepdim=True) / qmax).clamp_min(torch.finfo(torch.float32).tiny)
        return _round(xg / scale, act.kind, lo, hi).mul_(scale).reshape(m, k)
    else:
        scale = (x.abs().amax(dim=-1, keepdim=True) / qmax).clamp_min(torch.finfo(torch.float32).tiny)
    return _round(x / scale, act.kind, lo, hi) * scale


def _round(v: torch.Tensor, kind: str, lo: float, hi: float) -> torch.Tensor:
    v = v.clamp(lo, hi)
    return torch.round(v) if kind == "int8" else v.to(torch.float8_e4m3fn).float()


def reference_linear(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` in float32 from the dequantised weight (activations quantized first when ``w.act``
    says so): the reference every kernel is held to."""
    h = x.float().reshape(-1, x.shape[-1])
    if w.perm is not None:
        h = h[:, w.perm]
    if w.act is not None:
        h = fake_quant(h, w.act)
    y = torch.nn.functional.linear(h, w.dequantize(), None if bias is None else bias.float())
    return y.reshape(*x.shape[:-1], w.rows).to(x.dtype)
