"""``TritonModelOps``: the model ops of the GPU platforms that run Triton (CUDA, ROCm, XPU).

The torch defaults (cuBLAS/hipBLAS GEMMs) except for multi-LoRA, where ``lora_add`` launches the shrink and
expand kernels of ``lora_kernels.py`` once per layer for every slot of the step (the torch default is a
gather, two matmuls per slot and a scatter-add; the kernels read the step's mapping from device tensors
only, so a decode step with LoRA stays free of host synchronisation), and for a Llama layer's pointwise
ops: RMSNorm with its residual add, SiLU-and-mul and the rotary embedding are one kernel each
(``pointwise_kernels.py``) instead of the defaults' 3-10.
"""
from __future__ import annotations

import torch

from vllite_core.lora.mapping import LoRAMapping
from vllite_core.model_ops import ModelOps
from vllite_triton_kernels.status import interpreter_enabled


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, 1 << max(0, (n - 1).bit_length()))


class TritonModelOps(ModelOps):
    name = "triton"
    lora_graph_safe = True  # the kernels read the mapping from its device tensors; a graph uses the full rank

    def __init__(self, block_m: int = 16, block_n: int = 64, block_k: int = 64) -> None:
        self.block_m, self.block_n, self.block_k = block_m, block_n, block_k

    @staticmethod
    def _rows(*ts: torch.Tensor) -> bool:
        """2-D tensors with contiguous rows, on a device Triton runs on (or the interpreter), rows to do."""
        return all(t.dim() == 2 and t.stride(-1) == 1 and (t.device.type != "cpu" or interpreter_enabled())
                   for t in ts) and ts[0].shape[0] > 0

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not (self._rows(x) and weight.dtype == x.dtype and weight.is_contiguous()):
            return super().rms_norm(x, weight, eps)
        from vllite_triton_kernels.pointwise_kernels import rms_norm_kernel

        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        n = x.shape[1]
        rms_norm_kernel[(x.shape[0],)](x, x, weight, out, n, x.stride(0), 0, out.stride(0), eps,
                                       HAS_RESIDUAL=False, BLOCK=_pow2_at_least(n, 16))
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """In place: ``residual += x``, then ``x = rms_norm(residual)``."""
        if not (self._rows(x, residual) and x.shape == residual.shape and x.dtype == residual.dtype == weight.dtype
                and weight.is_contiguous()):
            return super().add_rms_norm(x, residual, weight, eps)
        from vllite_triton_kernels.pointwise_kernels import rms_norm_kernel

        n = x.shape[1]
        rms_norm_kernel[(x.shape[0],)](x, residual, weight, x, n, x.stride(0), residual.stride(0), x.stride(0), eps,
                                       HAS_RESIDUAL=True, BLOCK=_pow2_at_least(n, 16))
        return x, residual

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if not (self._rows(x) and x.shape[1] % 2 == 0):
            return super().silu_and_mul(x)
        from vllite_triton_kernels.pointwise_kernels import silu_and_mul_kernel

        n = x.shape[1] // 2
        out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
        block = min(1024, _pow2_at_least(n, 16))
        silu_and_mul_kernel[(x.shape[0], -(-n // block))](x, out, n, x.stride(0), out.stride(0), BLOCK=block)
        return out

    def rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """In place, when the head size is twice a power of two (the kernel's halves are ``tl.arange``s)."""
        d = q.shape[-1]
        if not (q.dim() == k.dim() == 3 and d % 2 == 0 and (d // 2) & (d // 2 - 1) == 0 and k.shape[-1] == d
                and q.stride(-1) == k.stride(-1) == 1 and self._rows(cos, sin) and cos.shape == sin.shape
                and cos.stride() == sin.stride() and cos.shape[1] == d and q.dtype == k.dtype == cos.dtype == sin.dtype
                and q.shape[0] == k.shape[0] == cos.shape[0]):
            return super().rotary(q, k, cos, sin)
        from vllite_triton_kernels.pointwise_kernels import rotary_kernel

        for x in (q, k):
            rotary_kernel[(x.shape[0],)](x, cos, sin, x.shape[1], x.stride(0), x.stride(1), cos.stride(0),
                                         HALF=d // 2, BLOCK_H=_pow2_at_least(x.shape[1], 1))
        return q, k

    def fused_moe(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, state: dict | None = None) -> torch.Tensor:
        """The experts on ``moe_kernels.py`` (two launches over tokens sorted by expert; no host sync)."""
        if not (self._rows(x) and x.dtype == w13.dtype == w2.dtype and w13.is_contiguous() and w2.is_contiguous()
                and topk_ids.dim() == 2 and topk_ids.device == x.device):
            return super().fused_moe(x, w13, w2, topk_weights, topk_ids, state)
        return fused_moe(x, w13, w2, topk_weights.to(x.dtype), topk_ids, self.block_m, self.block_n, self.block_k)

    def lora_add(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 ranks: list[int], mapping: LoRAMapping) -> torch.Tensor:
        if ((x.device.type == "cpu" and not interpreter_enabled()) or x.dim() != 2 or y.stride(-1) != 1
                or lora_a.stride(-1) != 1 or lora_b.stride(-1) != 1 or not x.dtype == y.dtype == lora_a.dtype):
            return super().lora_add(y, x, lora_a, lora_b, ranks, mapping)
        # Under a graph the slots' ranks may change between replays: every rank row (zero past a slot's own).
        rank = lora_a.shape[1] if mapping.static else max(ranks[s] for s in mapping.slots)
        sgmv_add(y, x if x.stride(-1) == 1 else x.contiguous(), lora_a, lora_b, rank, mapping, self.block_m,
                 self.block_n, self.block_k)
        return y


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, block_m: int = 16, block_n: int = 64, block_k: int = 64) -> torch.Tensor:
    """``ModelOps.fused_moe`` on ``moe_kernels.py``: the (token, slot) choices sorted by expert on the device, the
    gate/up GEMM with SiLU-and-mul in one launch, the down GEMM scaled by the routing weight in another, the k
    slots of each token summed."""
    from vllite_triton_kernels.moe_kernels import moe_down_kernel, moe_gate_up_kernel

    t, k = topk_ids.shape
    experts, hidden, inter = w13.shape[0], x.shape[1], w2.shape[2]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True).to(torch.int32)
    counts = torch.bincount(flat, minlength=experts).to(torch.int32)
    starts = (torch.cumsum(counts, 0) - counts).to(torch.int32)
    ieee = x.dtype == torch.float32
    h = torch.empty(t * k, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(t * k, hidden, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).contiguous()
    m_tiles = -(-(t * k) // block_m)  # enough for an expert that takes every choice
    moe_gate_up_kernel[(m_tiles, -(-inter // block_n), experts)](
        x, w13, h, order, starts, counts, hidden, inter, x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        TOP_K=k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee)
    moe_down_kernel[(m_tiles, -(-hidden // block_n), experts)](
        h, w2, y, weights, order, starts, counts, hidden, inter, h.stride(0), w2.stride(0), w2.stride(1),
        y.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee)
    return y.view(t, k, hidden).sum(1) if k > 1 else y


def sgmv_add(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, rank: int,
             mapping: LoRAMapping, block_m: int = 16, block_n: int = 64, block_k: int = 64) -> None:
    """``y[t] += x[t] @ lora_a[s, :rank].T @ lora_b[s, :rank]`` for every row t of every slot s of ``mapping``
    (rank rows past a slot's own must be zero): the shrink kernel into a float32 buffer, then the expand."""
    from vllite_triton_kernels.lora_kernels import lora_expand_kernel, lora_shrink_kernel

    rows = mapping.order.shape[0]
    if rows == 0 or rank == 0:
        return
    slots = lora_a.shape[0]
    r_p = _pow2_at_least(rank, 16)  # tl.dot wants every dimension >= 16
    ieee = x.dtype == torch.float32
    h = torch.empty(rows, rank, dtype=torch.float32, device=x.device)
    m_tiles = -(-rows // block_m)
    lora_shrink_kernel[(m_tiles, slots)](
        x, lora_a, h, mapping.order, mapping.seg_start, mapping.seg_len, x.shape[1], rank,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), h.stride(0),
        BLOCK_M=block_m, BLOCK_K=block_k, R_P=r_p, IEEE=ieee)
    lora_expand_kernel[(m_tiles, -(-y.shape[1] // block_n), slots)](
        h, lora_b, y, mapping.order, mapping.seg_start, mapping.seg_len, y.shape[1], rank,
        h.stride(0), lora_b.stride(0), lora_b.stride(1), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, R_P=r_p, IEEE=ieee)
