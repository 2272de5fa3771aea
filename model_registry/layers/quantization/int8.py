"""``quantization="int8"``: W8A8 with dynamic activations, quantized at load.

Each linear layer's weight becomes int8 with one float32 scale per output row (symmetric,
``scale = max|w_row| / 127``, round half to even); at run time every input row gets its own scale the same way,
the int8 x int8 products are summed exactly in int32 and the sum is scaled back (``ModelOps.int8_linear``).
Integer dot products are the fast path of CPUs with VNNI (about twice bf16's rate on the hosts measured) and
halve the weight bytes a decode step streams. The LM head and embeddings stay in the model dtype, as vLLM keeps
its LM heads in online quantization; with ``VLLITE_INT8_LM_HEAD=1`` the LM head is quantized the same way too (as
llama.cpp's quantized files do): a batch-64 SmolLM2 decode step on a VNNI CPU spends about a sixth of its time
in the bf16 head (docs/benchmarks.md has the measured speed and accuracy cost).
"""
from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from model_registry.layers.linear import LinearBase
from model_registry.layers.quantization.base import LinearLike, LinearMethod
from model_registry.layers.vocab import ParallelLMHead
from vllite_core.model_ops import quantize_rows_int8

INT8_LM_HEAD_ENV = "VLLITE_INT8_LM_HEAD"  # "1": quantization="int8" quantizes the LM head too


class Int8LinearMethod(LinearMethod):
    """int8 rows in ``layer.weight`` (or ``qweight`` here: the LM head, whose float table stays for the
    lookup) and their float32 scales (``weight_scale`` [out])."""

    name: ClassVar[str] = "int8"

    def __init__(self, weight_scale: torch.Tensor, qweight: torch.Tensor | None = None) -> None:
        self.weight_scale = weight_scale
        self.qweight = qweight

    @classmethod
    def quantize(cls, layer: LinearBase) -> None:
        """Replace ``layer``'s float weight by int8 rows and give it this method."""
        q, scale = quantize_rows_int8(layer.weight.data)
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.set_quant_method(cls(scale))

    @classmethod
    def quantize_head(cls, head: ParallelLMHead) -> None:
        """The LM head's logits from an int8 copy of this rank's rows (a tied table stays for the lookup)."""
        q, scale = quantize_rows_int8(head.weight.detach())
        head.set_quant_method(cls(scale, q))

    def apply(self, layer: LinearLike, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        w = layer.weight if self.qweight is None else self.qweight
        return layer.ops.int8_linear(x, w, self.weight_scale, bias, layer.state)

    def weight_bytes(self, layer: LinearLike) -> int:
        w = layer.weight if self.qweight is None else self.qweight
        return w.numel() + self.weight_scale.numel() * 4
