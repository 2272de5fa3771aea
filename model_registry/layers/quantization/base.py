"""What a linear layer's quantization method is: the object that owns its weights' layout and forward.

A linear layer (``model_registry.layers.linear``) loads its checkpoint tensors as the model dtype, then its
method may replace the layout once (``process_weights_after_loading``: int8 rows and scales, GGUF blocks) and
computes the product (``apply``) through the platform's ops. A new format is a new method: no model changes.
"""
from __future__ import annotations

from typing import ClassVar, Protocol

import torch

from vllite_core.model_ops import ModelOps


class LinearLike(Protocol):
    """What a method reads of its layer: a linear layer, or the LM head (``ParallelLMHead``)."""

    ops: ModelOps
    weight: torch.Tensor
    state: dict


class LinearMethod:
    """How one linear layer stores and multiplies its weight. Subclasses set ``name``."""

    name: ClassVar[str] = "unquantized"

    def apply(self, layer: LinearLike, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W.T + bias`` for this layer's weight in this method's layout."""
        return layer.ops.linear(x, layer.weight, bias, layer.state)

    def weight_bytes(self, layer: LinearLike) -> int:
        """Bytes the weight takes in this layout (what the quantization log reports)."""
        return layer.weight.numel() * layer.weight.element_size()


UNQUANTIZED = LinearMethod()  # stateless: every unquantized layer shares it
