"""EXAONE 4.0: OLMo 2's post-sublayer norms with Qwen3's per-head q/k norms; with a sliding window, its local
layers slide and rotate while its global layers have no rotary at all (global NoPE)."""
from __future__ import annotations

from typing import Any

from model_registry.models.dense import DenseForCausalLM, DenseSpec, need, standard_spec


class Exaone4ForCausalLM(DenseForCausalLM):
    family = "Exaone4ForCausalLM"

    @classmethod
    def spec(cls, c: Any) -> DenseSpec:
        layers = int(need(c, "num_hidden_layers", cls.family))
        kinds: list[str | None] = ["full_attention"] * layers
        if getattr(c, "sliding_window", None):
            types = list(need(c, "layer_types", cls.family))[:layers]
            kinds = ["full_attention" if t == "sliding_attention" else None for t in types]
        return standard_spec(c, cls.family, qk_norm="head", rope_kinds=kinds,
                             norms={"attn_out": "post_attention_layernorm", "mlp_out": "post_feedforward_layernorm"})
