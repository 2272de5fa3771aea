"""LFM2 (Lfm2ForCausalLM): gated short-convolution layers beside attention layers.

A conv layer computes ``C * conv(B * x)`` with a causal depthwise conv of ``conv_L_cache`` taps and
no activation; its per-request memory is the last ``conv_L_cache - 1`` inputs (a ``StateSpec``).
Attention layers (RoPE, per-head q/k RMS norms) hold paged KV blocks. Module names follow the HF
checkpoint's.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model_registry.layers import ReplicatedLinear, RMSNorm
from model_registry.layers.rotary import RotaryEmbedding
from model_registry.models.hf_weights import load_by_name, tie_loaded
from model_registry.models.mamba import Conv1d, Embedding, _param
from vllite_core.attention.backend import AttentionBackend
from vllite_core.core.kv_cache_spec import FullAttentionSpec, KVCacheSpec, StateSpec
from vllite_core.model_interfaces import IsStateful
from vllite_core.model_ops import current_model_ops
from vllite_core.state_cache import StateMetadata, gather_states, scatter_states


class ShortConv(nn.Module):
    def __init__(self, c: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.hidden = c.hidden_size
        self.kernel = c.conv_L_cache
        bias = bool(c.conv_bias)
        self.conv = Conv1d(c.hidden_size, self.kernel, bias, dtype)
        self.in_proj = ReplicatedLinear(c.hidden_size, 3 * c.hidden_size, bias, dtype)
        self.out_proj = ReplicatedLinear(c.hidden_size, c.hidden_size, bias, dtype)
        self._ops = current_model_ops()

    @property
    def state_shapes(self) -> list[tuple[int, ...]]:
        return [(self.hidden, self.kernel - 1)]

    def forward(self, x: torch.Tensor, cache: torch.Tensor, md: StateMetadata) -> torch.Tensor:
        states = gather_states(cache, md, tuple(self.state_shapes))
        (conv_state,) = states
        B, C, h = self.in_proj(x).chunk(3, dim=-1)
        h = self._ops.causal_conv1d((B * h).contiguous(), self.conv.weight[:, 0, :], self.conv.bias, conv_state,
                                    md.query_start_loc_cpu, None)
        scatter_states(cache, md, states)
        return self.out_proj(C * h)


class Attention(nn.Module):
    def __init__(self, c: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = c.num_attention_heads
        self.num_kv_heads = c.num_key_value_heads
        self.head_size = getattr(c, "head_dim", None) or c.hidden_size // self.num_heads
        eps = float(c.norm_eps)
        self.q_proj = ReplicatedLinear(c.hidden_size, self.num_heads * self.head_size, False, dtype)
        self.k_proj = ReplicatedLinear(c.hidden_size, self.num_kv_heads * self.head_size, False, dtype)
        self.v_proj = ReplicatedLinear(c.hidden_size, self.num_kv_heads * self.head_size, False, dtype)
        self.out_proj = ReplicatedLinear(self.num_heads * self.head_size, c.hidden_size, False, dtype)
        self.q_layernorm = RMSNorm(self.head_size, eps, dtype)
        self.k_layernorm = RMSNorm(self.head_size, eps, dtype)
        self.attn_backend = attn_backend
        self._ops = current_model_ops()

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, kv_cache: torch.Tensor,
                md: Any) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_layernorm(self.q_proj(x).view(t, self.num_heads, self.head_size))
        k = self.k_layernorm(self.k_proj(x).view(t, self.num_kv_heads, self.head_size))
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_size)
        q, k = self._ops.rotary(q.contiguous(), k.contiguous(), *rope)
        out = self.attn_backend.forward(q, k, v, kv_cache, md, self.head_size ** -0.5)
        return self.out_proj(out.reshape(t, -1))


def _ffn_size(c: Any) -> int:
    """LFM2's feed-forward width: with ``block_auto_adjust_ff_dim`` two thirds of ``intermediate_size``,
    scaled by ``block_ffn_dim_multiplier`` and rounded up to ``block_multiple_of``."""
    size = c.intermediate_size
    if c.block_auto_adjust_ff_dim:
        size = int(2 * size / 3)
        if c.block_ffn_dim_multiplier is not None:
            size = int(c.block_ffn_dim_multiplier * size)
            size = c.block_multiple_of * ((size + c.block_multiple_of - 1) // c.block_multiple_of)
    return size


class MLP(nn.Module):
    def __init__(self, c: Any, dtype: torch.dtype) -> None:
        super().__init__()
        size = _ffn_size(c)
        self.w1 = ReplicatedLinear(c.hidden_size, size, False, dtype)
        self.w3 = ReplicatedLinear(c.hidden_size, size, False, dtype)
        self.w2 = ReplicatedLinear(size, c.hidden_size, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Lfm2Layer(nn.Module):
    def __init__(self, c: Any, kind: str, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.is_attention = kind != "conv"
        if self.is_attention:
            self.self_attn = Attention(c, attn_backend, dtype)
        else:
            self.conv = ShortConv(c, dtype)
        self.feed_forward = MLP(c, dtype)
        self.operator_norm = RMSNorm(c.hidden_size, float(c.norm_eps), dtype)
        self.ffn_norm = RMSNorm(c.hidden_size, float(c.norm_eps), dtype)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, cache: torch.Tensor,
                md: Any) -> torch.Tensor:
        h = self.operator_norm(x)
        h = self.self_attn(rope, h, cache, md) if self.is_attention else self.conv(h, cache, md)
        x = x + h
        return x + self.feed_forward(self.ffn_norm(x))


class Lfm2Model(nn.Module):
    def __init__(self, c: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, dtype)
        self.layers = nn.ModuleList(Lfm2Layer(c, kind, attn_backend, dtype) for kind in c.layer_types)
        head_size = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.rotary_emb = RotaryEmbedding(c, head_size)
        self.embedding_norm = RMSNorm(c.hidden_size, float(c.norm_eps), dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[torch.Tensor],
                mds: list[Any]) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary_emb.lookup(positions, x.dtype)
        for layer, cache, md in zip(self.layers, caches, mds, strict=True):
            x = layer(rope, x, cache, md)
        return self.embedding_norm(x)


class Lfm2ForCausalLM(nn.Module, IsStateful):
    """Engine model for Lfm2ForCausalLM checkpoints."""

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = hf_config
        self.dtype = dtype
        self.vocab_size: int = hf_config.vocab_size
        self.model = Lfm2Model(hf_config, attn_backend, dtype)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))
        self.lm_head = (self.model.embed_tokens.weight if self.tie_word_embeddings
                        else _param(self.vocab_size, hf_config.hidden_size, dtype=dtype))
        self._ops = current_model_ops()
        self._head_state: dict = {}

    def get_kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec]:
        specs: list[KVCacheSpec] = []
        for layer in self.model.layers:
            if layer.is_attention:
                a = layer.self_attn
                specs.append(FullAttentionSpec(block_size, a.num_kv_heads, a.head_size, dtype))
            else:
                specs.append(StateSpec.of(block_size, layer.conv.state_shapes, self.dtype))
        return specs

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: list[Any]) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self._ops.linear(hidden_states, self.lm_head, None, self._head_state).float()

    def ensure_positions(self, max_model_len: int) -> None:
        self.model.rotary_emb.ensure_positions(max_model_len)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def rename(name: str) -> str | None:
            if name == "lm_head.weight":
                return None if self.tie_word_embeddings else "lm_head"
            return name

        loaded = load_by_name(self, weights, rename)
        if self.tie_word_embeddings:
            tie_loaded(self, loaded, "lm_head", "model.embed_tokens.weight")
        return loaded
