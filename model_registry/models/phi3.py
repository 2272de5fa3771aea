"""Phi-3 and Phi-4 (the same class): the Llama layout with q/k/v and gate/up stacked in the checkpoint
(``qkv_proj``, ``gate_up_proj``), LongRoPE (short and long factors; ``layers.rotary``), partial rotary, and
one sliding window for every layer when the config sets one."""
from __future__ import annotations

from typing import Any

from model_registry.layers.rotary import rotary_dim_of
from model_registry.models.dense import DenseForCausalLM, DenseSpec, standard_spec


class Phi3ForCausalLM(DenseForCausalLM):
    family = "Phi3ForCausalLM"

    @classmethod
    def spec(cls, c: Any) -> DenseSpec:
        base = standard_spec(c, cls.family)
        rotary = rotary_dim_of(c, base.head_size)
        return standard_spec(c, cls.family, rotary_dim=None if rotary == base.head_size else rotary)
