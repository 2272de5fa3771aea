"""Qwen3: the Llama layout with an RMSNorm over each head's q and k before the rotary (``q_norm``, ``k_norm``)."""
from __future__ import annotations

from typing import Any

from model_registry.models.dense import DenseForCausalLM, DenseSpec, standard_spec


class Qwen3ForCausalLM(DenseForCausalLM):
    family = "Qwen3ForCausalLM"

    @classmethod
    def spec(cls, c: Any) -> DenseSpec:
        bias = bool(getattr(c, "attention_bias", False))
        return standard_spec(c, cls.family, qk_norm="head", qkv_bias=bias, o_bias=bias)
