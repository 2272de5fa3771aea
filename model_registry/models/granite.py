"""Granite (3.x dense): the Llama layout with four scalars: ``embedding_multiplier`` on the token embeddings,
``residual_multiplier`` on what each sublayer adds, ``attention_multiplier`` as the attention scale, and the
logits divided by ``logits_scaling``."""
from __future__ import annotations

from typing import Any

from model_registry.models.dense import DenseForCausalLM, DenseSpec, need, standard_spec


class GraniteForCausalLM(DenseForCausalLM):
    family = "GraniteForCausalLM"

    @classmethod
    def spec(cls, c: Any) -> DenseSpec:
        bias = bool(getattr(c, "attention_bias", False))
        f = cls.family
        return standard_spec(c, f, qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(c, "mlp_bias", False)),
                             attn_scale=float(need(c, "attention_multiplier", f)),
                             embed_scale=float(need(c, "embedding_multiplier", f)),
                             residual_multiplier=float(need(c, "residual_multiplier", f)),
                             logits_divisor=float(need(c, "logits_scaling", f)))
