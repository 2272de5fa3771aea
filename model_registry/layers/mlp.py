"""The gated feed-forward most decoders share: ``down(silu(gate(x)) * up(x))``."""
from __future__ import annotations

import torch
from torch import nn

from model_registry.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from vllite_core.model_ops import ModelOps


class GatedMLP(nn.Module):
    """Gate and up in one column-parallel matmul (``gate_up_proj``: gate rows first; checkpoints name them
    ``gate_proj``/``up_proj``, or store them stacked as one tensor), SiLU-and-mul through the platform's ops,
    then the row-parallel ``down_proj``: the form a platform's fused decoder path reads."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype, bias: bool = False,
                 ops: ModelOps | None = None) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, {"gate": intermediate_size,
                                                                     "up": intermediate_size}, bias, dtype, ops)
        self.intermediate_size = self.gate_up_proj.segments["gate"].length  # this rank's part
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, dtype, ops=ops)
        self.ops = self.down_proj.ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(self.ops.silu_and_mul(self.gate_up_proj.forward(x)))
