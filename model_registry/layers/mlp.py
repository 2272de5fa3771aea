"""The gated feed-forward most decoders share: ``down(act(gate(x)) * up(x))``, SiLU unless the model names another
(Gemma's tanh GELU)."""
from __future__ import annotations

import torch
from torch import nn

from model_registry.layers.activation import gated
from model_registry.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from vllite_core.model_ops import ModelOps


class GatedMLP(nn.Module):
    """Gate and up in one column-parallel matmul (``gate_up_proj``: gate rows first; checkpoints name them
    ``gate_proj``/``up_proj``, or store them stacked as one tensor), SiLU-and-mul through the platform's ops,
    then the row-parallel ``down_proj``: the form a platform's fused decoder path reads. ``activation``: a
    ``hidden_act`` name other than silu goes through ``activation.gated``."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype, bias: bool = False,
                 ops: ModelOps | None = None, activation: str = "silu") -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, {"gate": intermediate_size,
                                                                     "up": intermediate_size}, bias, dtype, ops)
        self.intermediate_size = self.gate_up_proj.segments["gate"].length  # this rank's part
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, dtype, ops=ops)
        self.ops = self.down_proj.ops
        self.activation = "silu" if activation == "swish" else activation
        if self.activation != "silu":
            gated(self.activation, torch.zeros(2))  # an unknown name fails here, at build time

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj.forward(x)
        h = self.ops.silu_and_mul(h) if self.activation == "silu" else gated(self.activation, h)
        return self.down_proj.forward(h)
