"""The typed record a platform's fused decoder path reads: what one pre-norm decoder layer is made of.

A platform fuses a layer (the CPU platform runs it in one C++ call) from this record alone, never from a
model's attribute names: a model builds the record from its layers (``DecoderLayerRecord``), or says why it
cannot (a string, logged once by the platform). The linears and the attention layer are the live layers of
``model_registry.layers`` (their weight, quantization method, LoRA slot and float8 cache scales can change
after the record is made: a platform checks them per step).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from model_registry.layers.attention import Attention
from model_registry.layers.linear import LinearBase, RowParallelLinear
from vllite_core.model_ops import ModelOps


@dataclass(frozen=True)
class NormRecord:
    """A norm's kind, weight and epsilon: ``rms`` is Llama's RMSNorm (float32, cast back, then scaled)."""

    kind: Literal["rms"]
    weight: torch.Tensor
    eps: float


@dataclass(frozen=True)
class DecoderLayerRecord:
    """``h = x + o_proj(attention(rope(qkv_proj(input_norm(x)))))``; ``out = h + down_proj(act(gate) * up)`` over
    ``gate_up_proj(post_attention_norm(h))``, the residual adds fused into the next norm. ``rope``: ``neox``
    (``ModelOps.rotary`` on the model's cos/sin tables) or None (no positional rotation). ``ops``: the ops every
    part was built with (a platform takes only layers built with its own)."""

    input_norm: NormRecord
    post_attention_norm: NormRecord
    qkv_proj: LinearBase
    o_proj: RowParallelLinear
    gate_up_proj: LinearBase
    down_proj: RowParallelLinear
    attention: Attention
    activation: Literal["silu"]
    rope: Literal["neox"] | None
    ops: ModelOps
