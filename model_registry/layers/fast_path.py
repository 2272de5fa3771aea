"""The typed record a platform's fused decoder path reads: what one pre-norm decoder layer is made of.

A platform fuses a layer (the CPU platform runs it in one C++ call) from this record alone, never from a
model's attribute names: a model builds the record from its layers (``DecoderLayerRecord``), or says why it
cannot (a string, logged once by the platform). The linears and the attention layer are the live layers of
``model_registry.layers`` (their weight, quantization method, LoRA slot and float8 cache scales can change
after the record is made: a platform checks them per step).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

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


@runtime_checkable
class FusableLayer(Protocol):
    """A decoder layer that offers its record to the platform's fused path (``ModelOps.decoder_layer``)."""

    def fast_path_record(self) -> DecoderLayerRecord | str: ...

    def native_layer(self) -> Callable[..., tuple[torch.Tensor, torch.Tensor] | None] | None: ...


@dataclass(frozen=True)
class FastPathReport:
    """Which path each fusable decoder layer of a model runs: ``fused`` (the platform's call, step by step
    where a step allows it) or ``modules`` (the layer's own code, the reason logged once by the platform)."""

    paths: tuple[str, ...]

    @property
    def fused(self) -> int:
        return self.paths.count("fused")

    def describe(self, ops_name: str) -> str:
        if not self.paths:
            return f"model ops {ops_name}: no decoder layer offers a fused path"
        return f"model ops {ops_name}: {self.fused} of {len(self.paths)} decoder layers on the platform's fused path"


def report_fast_paths(model: torch.nn.Module) -> FastPathReport:
    """Ask the platform for every fusable layer's fused call now (after loading and quantization, when the weights
    are final; each layer keeps it) and say which path each runs."""
    return FastPathReport(tuple("fused" if m.native_layer() is not None else "modules"
                                for m in model.modules() if isinstance(m, FusableLayer)))
