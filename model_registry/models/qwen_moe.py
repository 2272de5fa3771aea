"""Qwen2-MoE and Qwen3-MoE (Qwen2MoeForCausalLM, Qwen3MoeForCausalLM): softmax top-k routing (renormalised when
``norm_topk_prob``); a layer has experts unless it is in ``mlp_only_layers`` or off the ``decoder_sparse_step``
stride, else a dense MLP. Qwen2-MoE adds a shared expert scaled by its own sigmoid gate and q/k/v bias;
Qwen3-MoE an RMSNorm on each q and k head before RoPE."""
from __future__ import annotations

from typing import Any

from model_registry.models.moe_decoder import MoeFamily, MoeForCausalLM

_RENAMES = ((".mlp.gate.", ".mlp.router."), (".mlp.shared_expert.", ".mlp.shared_experts."))


def _sparse_layers(c: Any) -> tuple[bool, ...]:
    dense = set(getattr(c, "mlp_only_layers", None) or ())
    step = int(getattr(c, "decoder_sparse_step", 1) or 1)
    return tuple(i not in dense and c.num_experts > 0 and (i + 1) % step == 0 for i in range(c.num_hidden_layers))


class Qwen2MoeForCausalLM(MoeForCausalLM):
    @classmethod
    def family(cls, c: Any) -> MoeFamily:
        return MoeFamily(num_experts=c.num_experts, top_k=c.num_experts_per_tok,
                         moe_intermediate_size=c.moe_intermediate_size, moe_layers=_sparse_layers(c),
                         renormalize=bool(c.norm_topk_prob), renames=_RENAMES, intermediate_size=c.intermediate_size,
                         shared_intermediate_size=c.shared_expert_intermediate_size or None,
                         shared_expert_gate=bool(c.shared_expert_intermediate_size), qkv_bias=True)


class Qwen3MoeForCausalLM(MoeForCausalLM):
    @classmethod
    def family(cls, c: Any) -> MoeFamily:
        return MoeFamily(num_experts=c.num_experts, top_k=c.num_experts_per_tok,
                         moe_intermediate_size=c.moe_intermediate_size, moe_layers=_sparse_layers(c),
                         renormalize=bool(c.norm_topk_prob), renames=_RENAMES, intermediate_size=c.intermediate_size,
                         qkv_bias=bool(getattr(c, "attention_bias", False)), qk_norm="head")
