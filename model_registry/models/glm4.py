"""GLM-4 (0414): four norms a layer (before and after attention, before and after the MLP), q/k/v bias, gate and
up stacked in one checkpoint tensor, and an interleaved (GPT-J style) rotary over part of each head."""
from __future__ import annotations

from typing import Any

from model_registry.layers.rotary import rotary_dim_of
from model_registry.models.dense import DenseForCausalLM, DenseSpec, standard_spec


class Glm4ForCausalLM(DenseForCausalLM):
    family = "Glm4ForCausalLM"

    @classmethod
    def spec(cls, c: Any) -> DenseSpec:
        base = standard_spec(c, cls.family)
        return standard_spec(
            c, cls.family, qkv_bias=bool(getattr(c, "attention_bias", True)), rope_style="interleaved",
            rotary_dim=rotary_dim_of(c, base.head_size),
            norms={"attn_in": "input_layernorm", "attn_out": "post_self_attn_layernorm",
                   "mlp_in": "post_attention_layernorm", "mlp_out": "post_mlp_layernorm"})
