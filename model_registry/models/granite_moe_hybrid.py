"""GraniteMoeHybrid (GraniteMoeHybridForCausalLM): Mamba-2 or attention layers, each followed by a top-k MoE
plus a shared SwiGLU MLP, with Granite's scalar multipliers (embeddings, residual branches, attention
scale, logits).

Mamba-2 layers hold a state (``StateSpec``), attention layers paged KV (RoPE only when
``position_embedding_type == "rope"``). The router takes the top-k logits and softmaxes over them;
``ModelOps.moe`` runs the experts. Module names follow the HF checkpoint's.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model_registry.layers import ReplicatedLinear, RMSNorm
from model_registry.layers.rotary import RotaryEmbedding
from model_registry.models.hf_weights import load_by_name
from model_registry.models.mamba import Embedding, _param
from model_registry.models.mamba2 import Mamba2Dims, Mamba2Mixer
from vllite_core.attention.backend import AttentionBackend
from vllite_core.core.kv_cache_spec import FullAttentionSpec, KVCacheSpec, StateSpec
from vllite_core.model_interfaces import IsStateful
from vllite_core.model_ops import current_model_ops


class Attention(nn.Module):
    def __init__(self, c: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = c.num_attention_heads
        self.num_kv_heads = c.num_key_value_heads
        self.head_size = getattr(c, "head_dim", None) or c.hidden_size // self.num_heads
        self.scale = float(c.attention_multiplier)
        bias = bool(c.attention_bias)
        self.q_proj = ReplicatedLinear(c.hidden_size, self.num_heads * self.head_size, bias, dtype)
        self.k_proj = ReplicatedLinear(c.hidden_size, self.num_kv_heads * self.head_size, bias, dtype)
        self.v_proj = ReplicatedLinear(c.hidden_size, self.num_kv_heads * self.head_size, bias, dtype)
        self.o_proj = ReplicatedLinear(self.num_heads * self.head_size, c.hidden_size, bias, dtype)
        self.attn_backend = attn_backend
        self._ops = current_model_ops()

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor] | None, x: torch.Tensor, kv_cache: torch.Tensor,
                md: Any) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_size)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_size)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_size)
        if rope is not None:
            q, k = self._ops.rotary(q, k, *rope)
        out = self.attn_backend.forward(q, k, v, kv_cache, md, self.scale)
        return self.o_proj(out.reshape(t, -1))


class _Weight(nn.Module):
    def __init__(self, *shape: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(*shape, dtype=dtype)


class SharedMLP(nn.Module):
    def __init__(self, c: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_linear = ReplicatedLinear(c.hidden_size, 2 * c.shared_intermediate_size, False, dtype)
        self.output_linear = ReplicatedLinear(c.shared_intermediate_size, c.hidden_size, False, dtype)
        self._ops = current_model_ops()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_linear(self._ops.silu_and_mul(self.input_linear(x)))


class MoE(nn.Module):
    """Experts stacked as in the checkpoint: ``input_linear`` [E, 2I, H] (gate, up), ``output_linear`` [E, H, I]."""

    def __init__(self, c: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.top_k = c.num_experts_per_tok
        self.router = nn.Module()
        self.router.layer = _Weight(c.num_local_experts, c.hidden_size, dtype=dtype)
        self.input_linear = _Weight(c.num_local_experts, 2 * c.intermediate_size, c.hidden_size, dtype=dtype)
        self.output_linear = _Weight(c.num_local_experts, c.hidden_size, c.intermediate_size, dtype=dtype)
        self._ops = current_model_ops()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.router.layer.weight).float()
        top, ids = logits.topk(self.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1).to(x.dtype)
        return self._ops.moe(x, self.input_linear.weight, self.output_linear.weight, weights, ids)


def _dims(c: Any) -> Mamba2Dims:
    return Mamba2Dims(hidden_size=c.hidden_size, num_heads=c.mamba_n_heads, head_dim=c.mamba_d_head,
                      n_groups=c.mamba_n_groups, state_size=c.mamba_d_state, conv_kernel=c.mamba_d_conv,
                      chunk_size=c.mamba_chunk_size, use_bias=bool(c.mamba_proj_bias),
                      use_conv_bias=bool(c.mamba_conv_bias), norm_eps=float(c.rms_norm_eps),
                      dt_limit=tuple(c.time_step_limit), activation=c.hidden_act)


class GraniteLayer(nn.Module):
    def __init__(self, c: Any, kind: str, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.kind = kind
        eps = float(c.rms_norm_eps)
        self.input_layernorm = RMSNorm(c.hidden_size, eps, dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, eps, dtype)
        if kind == "linear_attention":
            self.mamba = Mamba2Mixer(_dims(c), dtype)
        else:
            self.self_attn = Attention(c, attn_backend, dtype)
        self.block_sparse_moe = MoE(c, dtype) if c.num_local_experts > 0 else None
        self.shared_mlp = SharedMLP(c, dtype)
        self.residual_multiplier = float(c.residual_multiplier)

    def forward(self, rope: Any, x: torch.Tensor, cache: torch.Tensor, md: Any) -> torch.Tensor:
        h = self.input_layernorm(x)
        h = self.mamba(h, cache, md) if self.kind == "linear_attention" else self.self_attn(rope, h, cache, md)
        x = x + h * self.residual_multiplier
        h = self.post_attention_layernorm(x)
        ffn = self.shared_mlp(h)
        if self.block_sparse_moe is not None:
            ffn = self.block_sparse_moe(h) + ffn
        return x + ffn * self.residual_multiplier


class GraniteMoeHybridForCausalLM(nn.Module, IsStateful):
    """Engine model for GraniteMoeHybridForCausalLM checkpoints."""

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        c = hf_config
        self.config = c
        self.dtype = dtype
        self.vocab_size: int = c.vocab_size
        self.model = nn.Module()
        self.model.embed_tokens = Embedding(c.vocab_size, c.hidden_size, dtype)
        self.model.layers = nn.ModuleList(GraniteLayer(c, kind, attn_backend, dtype) for kind in c.layers_block_type)
        self.model.norm = RMSNorm(c.hidden_size, float(c.rms_norm_eps), dtype)
        head_size = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.rotary_emb = RotaryEmbedding(c, head_size) if c.position_embedding_type == "rope" else None
        self.embedding_multiplier = float(c.embedding_multiplier)
        self.logits_scaling = float(c.logits_scaling)
        self.tie_word_embeddings = bool(getattr(c, "tie_word_embeddings", False))
        self.lm_head = (self.model.embed_tokens.weight if self.tie_word_embeddings
                        else _param(self.vocab_size, c.hidden_size, dtype=dtype))
        self._ops = current_model_ops()
        self._head_state: dict = {}

    def get_kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec]:
        specs: list[KVCacheSpec] = []
        for layer in self.model.layers:
            if layer.kind == "linear_attention":
                specs.append(StateSpec.of(block_size, layer.mamba.state_shapes, self.dtype))
            else:
                a = layer.self_attn
                specs.append(FullAttentionSpec(block_size, a.num_kv_heads, a.head_size, dtype))
        return specs

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: list[Any]) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids) * self.embedding_multiplier
        rope = self.rotary_emb.lookup(positions, x.dtype) if self.rotary_emb is not None else None
        for layer, cache, md in zip(self.model.layers, kv_caches, attn_metadata, strict=True):
            x = layer(rope, x, cache, md)
        return self.model.norm(x)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self._ops.linear(hidden_states, self.lm_head, None, self._head_state).float()
        return logits / self.logits_scaling

    def ensure_positions(self, max_model_len: int) -> None:
        if self.rotary_emb is not None:
            self.rotary_emb.ensure_positions(max_model_len)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def rename(name: str) -> str | None:
            if name == "lm_head.weight":
                return None if self.tie_word_embeddings else "lm_head"
            return name

        loaded = load_by_name(self, weights, rename)
        if self.tie_word_embeddings and "model.embed_tokens.weight" in loaded:
            loaded.add("lm_head")
        return loaded
