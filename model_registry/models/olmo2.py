"""OLMo 2: norms after each sublayer instead of before (``post_attention_layernorm``,
``post_feedforward_layernorm``), and q/k norms over the whole projection (all heads at once)."""
from __future__ import annotations

from typing import Any

from model_registry.models.dense import DenseForCausalLM, DenseSpec, standard_spec


class Olmo2ForCausalLM(DenseForCausalLM):
    family = "Olmo2ForCausalLM"

    @classmethod
    def spec(cls, c: Any) -> DenseSpec:
        bias = bool(getattr(c, "attention_bias", False))
        return standard_spec(c, cls.family, qk_norm="all", qkv_bias=bias, o_bias=bias,
                             norms={"attn_out": "post_attention_layernorm", "mlp_out": "post_feedforward_layernorm"})
