"""Gemma 2 and Gemma 3 (text): ``(1 + w)`` norms before and after each sublayer, a tanh-GELU gated MLP, embeddings
scaled by sqrt(hidden), the attention scale ``query_pre_attn_scalar ** -0.5``, sliding-window and global layers
alternating (``layer_types``; each kind its own KV cache group). Gemma 2 soft-caps the attention scores and the
final logits; Gemma 3 normalises q and k per head and gives its local layers their own rope table (base, no
scaling) beside the global layers' (scaled)."""
from __future__ import annotations

from typing import Any

from model_registry.models.dense import DenseForCausalLM, DenseSpec, gemma_scale, need, sqrt_hidden, standard_spec

GEMMA_NORMS = {"attn_in": "input_layernorm", "attn_out": "post_attention_layernorm",
               "mlp_in": "pre_feedforward_layernorm", "mlp_out": "post_feedforward_layernorm"}


def _gemma(c: Any, family: str, **overrides: Any) -> DenseSpec:
    return standard_spec(
        c, family, norm="gemma", norms=dict(GEMMA_NORMS), activation=str(need(c, "hidden_activation", family)),
        attn_scale=gemma_scale(c, family), attn_soft_cap=getattr(c, "attn_logit_softcapping", None),
        final_soft_cap=getattr(c, "final_logit_softcapping", None), embed_scale=sqrt_hidden(c),
        embed_scale_in_dtype=True, **overrides)


class Gemma2ForCausalLM(DenseForCausalLM):
    family = "Gemma2ForCausalLM"

    @classmethod
    def spec(cls, c: Any) -> DenseSpec:
        need(c, "layer_types", cls.family)
        return _gemma(c, cls.family)


class Gemma3ForCausalLM(DenseForCausalLM):
    family = "Gemma3ForCausalLM"

    @classmethod
    def spec(cls, c: Any) -> DenseSpec:
        types = list(need(c, "layer_types", cls.family))[: int(c.num_hidden_layers)]
        kinds = ["sliding_attention" if t == "sliding_attention" else "full_attention" for t in types]
        return _gemma(c, cls.family, qk_norm="head", rope_kinds=kinds,
                      rope_bases={k: (k, None) for k in ("sliding_attention", "full_attention")})
