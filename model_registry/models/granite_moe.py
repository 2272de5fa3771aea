"""GraniteMoE (GraniteMoeForCausalLM): Mixtral's shape with Granite's scalar multipliers (embeddings, residual
branches, a fixed attention scale, logits divided by ``logits_scaling``); the router softmaxes over the top-k
logits; experts are stored stacked (``input_linear`` [E, 2I, H], gate rows first; ``output_linear`` [E, H, I])."""
from __future__ import annotations

from typing import Any

from model_registry.models.moe_decoder import MoeFamily, MoeForCausalLM

_RENAMES = ((".block_sparse_moe.router.layer.", ".mlp.router."),
            (".block_sparse_moe.input_linear.weight", ".mlp.w13_weight"),
            (".block_sparse_moe.output_linear.weight", ".mlp.w2_weight"))


class GraniteMoeForCausalLM(MoeForCausalLM):
    @classmethod
    def family(cls, c: Any) -> MoeFamily:
        return MoeFamily(num_experts=c.num_local_experts, top_k=c.num_experts_per_tok,
                         moe_intermediate_size=c.intermediate_size, moe_layers=(True,) * c.num_hidden_layers,
                         renormalize=True, renames=_RENAMES, attention_scale=float(c.attention_multiplier),
                         embedding_multiplier=float(c.embedding_multiplier),
                         residual_multiplier=float(c.residual_multiplier), logits_scaling=float(c.logits_scaling))
