"""Zamba2 (Zamba2ForCausalLM): a Mamba-2 stack where "hybrid" layers first run a *shared* transformer block.

The shared block (``num_mem_blocks`` of them, reused in turn by the hybrid layers) reads the current
hidden states concatenated with the original embeddings, attends (paged KV per hybrid layer), runs a
MLP, and its output, through the layer's own linear, is added to the Mamba layer's input. Each hybrid
layer has its own low-rank adapters on the shared block's projections. A mamba layer holds a state; a
hybrid layer holds KV then a state (that order in ``kv_caches``). Module names follow the HF checkpoint's.
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

_ACTS = {"gelu": lambda x: F.gelu(x), "silu": F.silu, "swish": F.silu}


def _adapters(c: Any, block_id: int, size_in: int, size_out: int, dtype: torch.dtype) -> nn.ModuleList:
    """One entry per hybrid layer: a low-rank adapter where that layer uses this block, else nothing."""
    n = len(c.hybrid_layer_ids)
    return nn.ModuleList(
        nn.Sequential(ReplicatedLinear(size_in, c.adapter_rank, False, dtype),
                      ReplicatedLinear(c.adapter_rank, size_out, False, dtype))
        if i % c.num_mem_blocks == block_id else nn.Identity() for i in range(n))


class SharedAttention(nn.Module):
    def __init__(self, c: Any, block_id: int, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        width = c.attention_hidden_size
        self.num_heads, self.num_kv_heads, self.head_size = c.num_attention_heads, c.num_key_value_heads, \
            c.attention_head_dim
        self.scale = (self.head_size / 2) ** -0.5
        self.q_proj = ReplicatedLinear(width, self.num_heads * self.head_size, False, dtype)
        self.k_proj = ReplicatedLinear(width, self.num_kv_heads * self.head_size, False, dtype)
        self.v_proj = ReplicatedLinear(width, self.num_kv_heads * self.head_size, False, dtype)
        self.o_proj = ReplicatedLinear(self.num_heads * self.head_size, c.hidden_size, False, dtype)
        self.use_adapters = bool(c.use_shared_attention_adapter)
        if self.use_adapters:
            self.linear_q_adapter_list = _adapters(c, block_id, width, width, dtype)
            self.linear_k_adapter_list = _adapters(c, block_id, width, width, dtype)
            self.linear_v_adapter_list = _adapters(c, block_id, width, width, dtype)
        self.attn_backend = attn_backend
        self._ops = current_model_ops()

    def forward(self, rope: Any, x: torch.Tensor, hybrid_index: int, kv_cache: torch.Tensor, md: Any) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.use_adapters:
            q = q + self.linear_q_adapter_list[hybrid_index](x)
            k = k + self.linear_k_adapter_list[hybrid_index](x)
            v = v + self.linear_v_adapter_list[hybrid_index](x)
        q = q.view(t, self.num_heads, self.head_size)
        k = k.view(t, self.num_kv_heads, self.head_size)
        v = v.view(t, self.num_kv_heads, self.head_size)
        if rope is not None:
            q, k = self._ops.rotary(q, k, *rope)
        out = self.attn_backend.forward(q, k, v, kv_cache, md, self.scale)
        return self.o_proj(out.reshape(t, -1))


class SharedMLP(nn.Module):
    def __init__(self, c: Any, block_id: int, dtype: torch.dtype) -> None:
        super().__init__()
        if c.hidden_act not in _ACTS:
            raise NotImplementedError(f"Zamba2 hidden_act {c.hidden_act!r} (gelu or silu)")
        self.act = _ACTS[c.hidden_act]
        bias = bool(c.add_bias_linear)
        self.gate_up_proj = ReplicatedLinear(c.hidden_size, 2 * c.intermediate_size, bias, dtype)
        self.down_proj = ReplicatedLinear(c.intermediate_size, c.hidden_size, bias, dtype)
        self.gate_up_proj_adapter_list = _adapters(c, block_id, c.hidden_size, 2 * c.intermediate_size, dtype)

    def forward(self, x: torch.Tensor, hybrid_index: int) -> torch.Tensor:
        gate, up = (self.gate_up_proj(x) + self.gate_up_proj_adapter_list[hybrid_index](x)).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class SharedTransformer(nn.Module):
    def __init__(self, c: Any, block_id: int, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.attention_hidden_size, float(c.rms_norm_eps), dtype)
        self.self_attn = SharedAttention(c, block_id, attn_backend, dtype)
        self.pre_ff_layernorm = RMSNorm(c.hidden_size, float(c.rms_norm_eps), dtype)
        self.feed_forward = SharedMLP(c, block_id, dtype)

    def forward(self, rope: Any, x: torch.Tensor, original: torch.Tensor, hybrid_index: int,
                kv_cache: torch.Tensor, md: Any) -> torch.Tensor:
        h = self.input_layernorm(torch.cat([x, original], dim=-1))
        h = self.pre_ff_layernorm(self.self_attn(rope, h, hybrid_index, kv_cache, md))
        return self.feed_forward(h, hybrid_index)


class MambaLayer(nn.Module):
    def __init__(self, c: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, float(c.rms_norm_eps), dtype)
        self.mamba = Mamba2Mixer(Mamba2Dims(
            hidden_size=c.hidden_size, num_heads=c.n_mamba_heads, head_dim=c.mamba_headdim, n_groups=c.mamba_ngroups,
            state_size=c.mamba_d_state, conv_kernel=c.mamba_d_conv, chunk_size=c.chunk_size,
            use_bias=bool(c.add_bias_linear), use_conv_bias=True, norm_eps=1e-5,
            dt_limit=(float(c.time_step_min), float("inf")), activation="silu"), dtype)

    def forward(self, x: torch.Tensor, cache: torch.Tensor, md: Any, added: torch.Tensor | None = None
                ) -> torch.Tensor:
        h = self.input_layernorm(x if added is None else x + added)
        return x + self.mamba(h, cache, md)


class HybridLayer(nn.Module):
    def __init__(self, shared: SharedTransformer, c: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.shared_transformer = shared
        self.linear = ReplicatedLinear(c.hidden_size, c.hidden_size, False, dtype)
        self.mamba_decoder = MambaLayer(c, dtype)


class Zamba2ForCausalLM(nn.Module, IsStateful):
    """Engine model for Zamba2ForCausalLM checkpoints (shared blocks stored once, under their first layer)."""

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        c = hf_config
        if getattr(c, "use_long_context", False):
            raise NotImplementedError("Zamba2 use_long_context (rescaled RoPE) is not supported")
        self.config = c
        self.dtype = dtype
        self.vocab_size: int = c.vocab_size
        shared = [SharedTransformer(c, b, attn_backend, dtype) for b in range(c.num_mem_blocks)]
        self.hybrid_index: dict[int, int] = {layer: i for i, layer in enumerate(c.hybrid_layer_ids)}
        layers: list[nn.Module] = []
        for i, kind in enumerate(c.layers_block_type):
            if kind == "hybrid":
                layers.append(HybridLayer(shared[self.hybrid_index[i] % c.num_mem_blocks], c, dtype))
            else:
                layers.append(MambaLayer(c, dtype))
        self.model = nn.Module()
        self.model.embed_tokens = Embedding(c.vocab_size, c.hidden_size, dtype)
        self.model.layers = nn.ModuleList(layers)
        self.model.final_layernorm = RMSNorm(c.hidden_size, float(c.rms_norm_eps), dtype)
        self.rotary_emb = RotaryEmbedding(c, c.attention_head_dim) if c.use_mem_rope else None
        self.tie_word_embeddings = bool(getattr(c, "tie_word_embeddings", True))
        self.lm_head = (self.model.embed_tokens.weight if self.tie_word_embeddings
                        else _param(self.vocab_size, c.hidden_size, dtype=dtype))
        self._ops = current_model_ops()
        self._head_state: dict = {}

    def get_kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec]:
        specs: list[KVCacheSpec] = []
        for layer in self.model.layers:
            if isinstance(layer, HybridLayer):
                a = layer.shared_transformer.self_attn
                specs.append(FullAttentionSpec(block_size, a.num_kv_heads, a.head_size, dtype))
                layer = layer.mamba_decoder
            specs.append(StateSpec.of(block_size, layer.mamba.state_shapes, self.dtype))
        return specs

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: list[Any]) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        original = x
        rope = self.rotary_emb.lookup(positions, x.dtype) if self.rotary_emb is not None else None
        i = 0
        for n, layer in enumerate(self.model.layers):
            if isinstance(layer, HybridLayer):
                t = layer.shared_transformer(rope, x, original, self.hybrid_index[n], kv_caches[i], attn_metadata[i])
                i += 1
                x = layer.mamba_decoder(x, kv_caches[i], attn_metadata[i], added=layer.linear(t))
            else:
                x = layer(x, kv_caches[i], attn_metadata[i])
            i += 1
        return self.model.final_layernorm(x)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self._ops.linear(hidden_states, self.lm_head, None, self._head_state).float()

    def ensure_positions(self, max_model_len: int) -> None:
        if self.rotary_emb is not None:
            self.rotary_emb.ensure_positions(max_model_len)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def rename(name: str) -> str | None:
            if name == "lm_head.weight":
                return None if self.tie_word_embeddings else "lm_head"
            return name

        loaded = load_by_name(self, weights, rename)
        # A shared block (and a tied head) is one parameter under several names: loaded under one, loaded.
        names: dict[int, list[str]] = {}
        for name, p in self.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        for aliases in names.values():
            if loaded.intersection(aliases):
                loaded.update(aliases)
        return loaded
