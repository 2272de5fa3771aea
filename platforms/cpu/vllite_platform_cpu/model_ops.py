"""The CPU platform's model ops: oneDNN-prepacked linear layers and the C++ fused pointwise kernels.

Each op checks that its inputs are what its kernel handles and otherwise hands the call to the torch
defaults (``vllite_core.model_ops.ModelOps``), so a model never depends on the kernels being built.
"""
from __future__ import annotations

import torch

from vllite_core.model_ops import ModelOps
from vllite_platform_cpu import kernels

# Up to this many rows the weight-streaming C++ kernel beats a GEMM (memory-bound, few FLOPs per byte).
SMALL_LINEAR_MAX_ROWS = 4


def onednn_linear_available() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class CpuModelOps(ModelOps):
    """Fused kernels when ``fused`` (the C++ extension built), prepacked weights when ``packed_linear``."""

    def __init__(self, fused: bool, packed_linear: bool) -> None:
        self.fused = fused
        self.packed_linear = packed_linear
        self.name = "+".join(n for n, on in (("cpu-fused", fused), ("onednn-linear", packed_linear)) if on) or "torch"

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: dict) -> torch.Tensor:
        """oneDNN's blocked weight layout made this model's linear layers 1.1-1.3x faster than F.linear
        (MKL) at 64-2048 rows and the LM head 2x at 64 rows on an AVX2 host. The packed copy is made on
        first use and remade when the weight changes (an in-place load bumps its version). float32 only:
        oneDNN's bf16 path needs native bf16 math. A few rows go to the C++ matrix-vector kernel."""
        if (x.dim() != 2 or x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu"
                or torch.is_grad_enabled()):
            return super().linear(x, weight, bias, state)
        if self.fused and x.shape[0] <= SMALL_LINEAR_MAX_ROWS and weight.is_contiguous() \
                and (bias is None or bias.dtype == torch.float32):
            out = x.new_empty(x.shape[0], weight.shape[0])
            kernels.small_linear(out, x.contiguous(), weight, bias)
            return out
        if not self.packed_linear:
            return super().linear(x, weight, bias, state)
        key = (weight.data_ptr(), weight._version)
        if state.get("key") != key:
            state["packed"] = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
            state["key"] = key
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), state["packed"], bias, "none", [], "")

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not (self._rows_ok(x) and weight.dtype == x.dtype):
            return super().rms_norm(x, weight, eps)
        out = torch.empty_like(x)
        kernels.rms_norm(out, x, weight, eps)
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if not (self._rows_ok(x) and self._rows_ok(residual) and x.shape == residual.shape
                and x.dtype == residual.dtype == weight.dtype):
            return super().add_rms_norm(x, residual, weight, eps)
        kernels.add_rms_norm(x, residual, weight, eps)  # residual += x; x = norm(residual)
        return x, residual

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if not (self._rows_ok(x) and x.shape[1] % 2 == 0):
            return super().silu_and_mul(x)
        out = x.new_empty(x.shape[0], x.shape[1] // 2)
        kernels.silu_and_mul(out, x)
        return out

    def rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not (self.fused and q.device.type == "cpu" and q.dim() == 3 and k.dim() == 3 and q.stride(-1) == 1
                and k.stride(-1) == 1 and cos.dim() == 2 and cos.stride(-1) == 1 and sin.stride() == cos.stride()
                and q.dtype == k.dtype == cos.dtype == sin.dtype and not torch.is_grad_enabled()):
            return super().rotary(q, k, cos, sin)
        kernels.rotary(q, k, cos, sin)
        return q, k

    def _rows_ok(self, x: torch.Tensor) -> bool:
        return (self.fused and x.device.type == "cpu" and x.dim() == 2 and x.stride(-1) == 1
                and not torch.is_grad_enabled())
