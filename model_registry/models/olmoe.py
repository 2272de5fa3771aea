"""OLMoE (OlmoeForCausalLM): an RMSNorm over the whole q and k projections (before the heads split), optional
q/k/v clipping (``clip_qkv``), every layer a softmax top-k MoE (renormalised when ``norm_topk_prob``)."""
from __future__ import annotations

from typing import Any

from model_registry.models.moe_decoder import MoeFamily, MoeForCausalLM


class OlmoeForCausalLM(MoeForCausalLM):
    @classmethod
    def family(cls, c: Any) -> MoeFamily:
        return MoeFamily(num_experts=c.num_experts, top_k=c.num_experts_per_tok,
                         moe_intermediate_size=c.intermediate_size, moe_layers=(True,) * c.num_hidden_layers,
                         renormalize=bool(c.norm_topk_prob), renames=((".mlp.gate.", ".mlp.router."),),
                         qkv_bias=bool(getattr(c, "attention_bias", False)), qk_norm="full",
                         clip_qkv=getattr(c, "clip_qkv", None))
