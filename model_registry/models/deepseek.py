"""DeepSeek-V2 and DeepSeek-V3 (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM): multi-head latent attention
(``layers.mla``: a latent + rope-key cache, the absorbed form at decode), the first ``first_k_dense_replace``
layers dense, the rest a routed MoE plus ``n_shared_experts`` shared experts. V2 routes by softmax (grouped
when ``topk_method`` is ``group_limited_greedy``: each group scored by its best expert); V3 by sigmoid scores
with a correction bias that steers the choice (groups scored by their best two), renormalised when
``norm_topk_prob``; both scale the routed weights by ``routed_scaling_factor``."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from model_registry.layers.mla import MLAAttention
from model_registry.models.moe_decoder import MoeFamily, MoeForCausalLM
from vllite_core.attention.backend import AttentionBackend
from vllite_core.distributed.sharding import split
from vllite_core.errors import ConfigError

_RENAMES = ((".mlp.gate.", ".mlp.router."),)


def _num_experts(c: Any) -> int:
    for name in ("n_routed_experts", "num_local_experts", "num_experts"):
        if getattr(c, name, None):
            return int(getattr(c, name))
    raise ValueError("DeepSeek config names no routed experts (n_routed_experts)")


def _family(c: Any, v3: bool) -> MoeFamily:
    grouped = v3 or getattr(c, "topk_method", "greedy") == "group_limited_greedy"
    first_dense = int(getattr(c, "first_k_dense_replace", 0) or 0)
    shared = int(getattr(c, "n_shared_experts", 0) or 0)
    return MoeFamily(num_experts=_num_experts(c), top_k=c.num_experts_per_tok,
                     moe_intermediate_size=c.moe_intermediate_size,
                     moe_layers=tuple(i >= first_dense for i in range(c.num_hidden_layers)),
                     renormalize=v3 and bool(getattr(c, "norm_topk_prob", False)), renames=_RENAMES,
                     intermediate_size=c.intermediate_size,
                     shared_intermediate_size=c.moe_intermediate_size * shared or None,
                     scoring="sigmoid" if v3 else "softmax", n_group=c.n_group if grouped else None,
                     topk_group=c.topk_group if grouped else None, correction_bias=v3,
                     routed_scaling_factor=float(getattr(c, "routed_scaling_factor", 1.0) or 1.0))


class DeepseekV2ForCausalLM(MoeForCausalLM):
    v3 = False

    @classmethod
    def check_tensor_parallel(cls, hf_config: Any, tensor_parallel_size: int) -> None:
        """MLA splits by heads (no KV heads: every rank holds the latents), so at most one rank per head."""
        if tensor_parallel_size > hf_config.num_attention_heads:
            raise ConfigError(f"tensor_parallel_size: {tensor_parallel_size} ranks is more than {cls.__name__}'s "
                              f"{hf_config.num_attention_heads} attention heads")

    @classmethod
    def tensor_parallel_layout(cls, hf_config: Any, tensor_parallel_size: int) -> list[str]:
        """Each rank's query heads (``MLAAttention`` splits them near-evenly; the latents are on every rank)."""
        heads = hf_config.num_attention_heads
        spans = [split(heads, tensor_parallel_size, r) for r in range(tensor_parallel_size)]
        return [f"tensor-parallel rank {r}: query heads {a}-{b - 1} ({b - a}) of {heads}, the whole latent KV"
                for r, (a, b) in enumerate(spans)]

    @classmethod
    def family(cls, c: Any) -> MoeFamily:
        return _family(c, cls.v3)

    def make_attention(self, c: Any, fam: MoeFamily, layer: int, backend: AttentionBackend,
                       dtype: torch.dtype) -> nn.Module:
        return MLAAttention(c, dtype)

    @classmethod
    def rotary_dim(cls, c: Any) -> int:
        return c.qk_rope_head_dim


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    v3 = True
