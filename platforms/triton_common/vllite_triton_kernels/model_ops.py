"""``TritonModelOps``: the model ops of the GPU platforms that run Triton (CUDA, ROCm, XPU).

The torch defaults everywhere except multi-LoRA, where ``lora_add`` launches the shrink and expand
kernels of ``lora_kernels.py`` once per layer for every slot of the step (the torch default is a
gather, two matmuls per slot and a scatter-add). The kernels read the step's mapping from device
tensors only, so a decode step with LoRA stays free of host synchronisation.
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
