"""SmolLM3: the Llama layout where some layers have no rotary embedding at all (NoPE: ``no_rope_layers[i] == 0``).
Its rotary layers take the CPU platform's fused decoder layer one by one; the NoPE layers run their modules."""
from __future__ import annotations

from typing import Any

from model_registry.models.dense import DenseForCausalLM, DenseSpec, need, standard_spec


class SmolLM3ForCausalLM(DenseForCausalLM):
    family = "SmolLM3ForCausalLM"

    @classmethod
    def spec(cls, c: Any) -> DenseSpec:
        layers = int(need(c, "num_hidden_layers", cls.family))
        uses_rope = list(need(c, "no_rope_layers", cls.family))[:layers]
        bias = bool(getattr(c, "attention_bias", False))
        return standard_spec(c, cls.family, qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(c, "mlp_bias", False)),
                             rope_kinds=["full_attention" if r else None for r in uses_rope])
