"""Mixtral (MixtralForCausalLM): Llama-style attention, every layer a softmax top-k MoE with the chosen
weights renormalised; checkpoints name the block ``block_sparse_moe`` and its experts ``w1``/``w2``/``w3``."""
from __future__ import annotations

from typing import Any

from model_registry.models.moe_decoder import MoeFamily, MoeForCausalLM


class MixtralForCausalLM(MoeForCausalLM):
    @classmethod
    def family(cls, c: Any) -> MoeFamily:
        return MoeFamily(num_experts=c.num_local_experts, top_k=c.num_experts_per_tok,
                         moe_intermediate_size=c.intermediate_size, moe_layers=(True,) * c.num_hidden_layers,
                         renormalize=True, renames=((".block_sparse_moe.gate.", ".mlp.router."),
                                                    (".block_sparse_moe.", ".mlp.")))
