"""The pointwise pieces of a transformer layer, as one object a platform may replace.

Models call ``current_model_ops()`` when they build their layers and keep what it returns; the
worker builds the model inside ``use_model_ops(platform.model_ops(config))``. The defaults here are
plain torch, written in the order transformers computes them (the numerics models are tested
against); a platform returns a subclass that fuses them (the CPU platform's C++ kernels), and falls
back to these for anything its kernels do not cover. Outside a worker (a model built by hand in a
test) the defaults apply.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
import torch.nn.functional as F


class ModelOps:
    """Torch reference implementations; every method returns new tensors or documents what it mutates."""

    name = "torch"

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               state: dict) -> torch.Tensor:
        """``x @ weight.T + bias``. ``state`` is a per-layer dict a platform may cache a repacked weight in."""
        return F.linear(x, weight, bias)

    def int8_linear(self, x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None, state: dict) -> torch.Tensor:
        """W8A8 linear (``vllite_core.quantization``): ``x`` quantized per row like the weight, the int8
        products summed, scaled by both scales, ``bias`` added, in ``x``'s dtype. Here in float64, where
        every int8 sum of a layer this size is exact: a reference, not a fast path."""
        from vllite_core.quantization import quantize_rows_int8

        xq, xs = quantize_rows_int8(x)
        acc = xq.double() @ qweight.double().T
        y = (acc * xs.double()[:, None] * weight_scale.double()[None, :]).float()
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(residual + x), residual + x)``; an implementation may reuse ``x`` and ``residual``'s storage."""
        residual = residual + x
        return self.rms_norm(residual, weight, eps), residual

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(x[..., :n]) * x[..., n:]`` for ``x`` of last dimension ``2n``."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """NeoX-layout rotary embedding of ``q`` [T, H, D] and ``k`` [T, Hkv, D]; ``cos``/``sin`` are [T, D].
        An implementation may rotate ``q`` and ``k`` in place."""
        cos, sin = cos[:, None, :], sin[:, None, :]
        return rotate_neox(q, cos, sin), rotate_neox(k, cos, sin)

    def lora_add(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 groups: list[tuple[int, int, torch.Tensor | None]]) -> torch.Tensor:
        """Multi-LoRA: add each group's low-rank update to the base output ``y`` [T, out] in place and return it.
        ``lora_a`` [slots, R, in] and ``lora_b`` [slots, out, R] are the stacked adapters; a group
        ``(slot, rank, idx)`` gives ``y[idx] += x[idx] @ lora_a[slot, :rank].T @ lora_b[slot, :, :rank].T``
        (``idx`` None: every row). One shrink and one expand per active slot (segmented, not per request)."""
        for slot, rank, idx in groups:
            a, b = lora_a[slot, :rank], lora_b[slot, :, :rank]
            if idx is None:
                y.add_(F.linear(F.linear(x, a), b))
            else:
                y.index_add_(0, idx, F.linear(F.linear(x.index_select(0, idx), a), b))
        return y


def rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin (the HF/NeoX layout: the two halves of each head are paired)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


_current: contextvars.ContextVar[ModelOps | None] = contextvars.ContextVar("vllite_model_ops", default=None)
_DEFAULT = ModelOps()


def current_model_ops() -> ModelOps:
    """The ops for the model being built (the platform's inside ``use_model_ops``, else the torch defaults)."""
    return _current.get() or _DEFAULT


@contextlib.contextmanager
def use_model_ops(ops: ModelOps) -> Iterator[ModelOps]:
    token = _current.set(ops)
    try:
        yield ops
    finally:
        _current.reset(token)
