"""Jamba (JambaForCausalLM): Mamba-1 layers and attention layers in one stack, dense or MoE feed-forwards.

The hybrid that proves two kinds of cache in one model: attention layers hold paged KV blocks
(``FullAttentionSpec``, one group), Mamba layers hold a per-request state (``StateSpec``, another
group), all from the one block pool. Attention has no positional encoding (the Mamba layers carry
order). MoE layers route each token to its top-k experts by an unnormalised softmax
(``ModelOps.moe`` runs the experts). Module names follow the HF checkpoint's.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model_registry.layers import ReplicatedLinear, RMSNorm
from model_registry.models.mamba import Embedding, MambaMixer, _param
from vllite_core.attention.backend import AttentionBackend
from vllite_core.core.kv_cache_spec import FullAttentionSpec, KVCacheSpec, StateSpec
from vllite_core.model_interfaces import IsStateful
from vllite_core.model_ops import current_model_ops


class Attention(nn.Module):
    """Causal GQA self-attention over the paged KV cache, no rotary embedding."""

    def __init__(self, c: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = c.num_attention_heads
        self.num_kv_heads = c.num_key_value_heads
        self.head_size = getattr(c, "head_dim", None) or c.hidden_size // self.num_heads
        self.q_proj = ReplicatedLinear(c.hidden_size, self.num_heads * self.head_size, False, dtype)
        self.k_proj = ReplicatedLinear(c.hidden_size, self.num_kv_heads * self.head_size, False, dtype)
        self.v_proj = ReplicatedLinear(c.hidden_size, self.num_kv_heads * self.head_size, False, dtype)
        self.o_proj = ReplicatedLinear(self.num_heads * self.head_size, c.hidden_size, False, dtype)
        self.attn_backend = attn_backend

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, md: Any) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_size)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_size)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_size)
        out = self.attn_backend.forward(q, k, v, kv_cache, md, self.head_size ** -0.5)
        return self.o_proj(out.reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, c: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = ReplicatedLinear(c.hidden_size, c.intermediate_size, False, dtype)
        self.up_proj = ReplicatedLinear(c.hidden_size, c.intermediate_size, False, dtype)
        self.down_proj = ReplicatedLinear(c.intermediate_size, c.hidden_size, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """Stacked expert weights: ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]."""

    def __init__(self, c: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = _param(c.num_experts, 2 * c.intermediate_size, c.hidden_size, dtype=dtype)
        self.down_proj = _param(c.num_experts, c.hidden_size, c.intermediate_size, dtype=dtype)


class Router(nn.Module):
    def __init__(self, c: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(c.num_experts, c.hidden_size, dtype=dtype)


class SparseMoe(nn.Module):
    def __init__(self, c: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.top_k = c.num_experts_per_tok
        self.router = Router(c, dtype)
        self.experts = Experts(c, dtype)
        self._ops = current_model_ops()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(F.linear(x, self.router.weight), dim=-1, dtype=torch.float)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        return self._ops.moe(x, self.experts.gate_up_proj, self.experts.down_proj, weights.to(x.dtype), ids)


def _mamba_names(c: Any) -> SimpleNamespace:
    return SimpleNamespace(hidden_size=c.hidden_size, intermediate_size=c.mamba_expand * c.hidden_size,
                           state_size=c.mamba_d_state, conv_kernel=c.mamba_d_conv, time_step_rank=c.mamba_dt_rank,
                           use_bias=c.mamba_proj_bias, use_conv_bias=c.mamba_conv_bias, hidden_act=c.hidden_act)


class JambaLayer(nn.Module):
    def __init__(self, c: Any, kind: str, num_experts: int, attn_backend: AttentionBackend,
                 dtype: torch.dtype) -> None:
        super().__init__()
        eps = float(c.rms_norm_eps)
        self.kind = kind
        if kind == "attention":
            self.self_attn = Attention(c, attn_backend, dtype)
        else:
            self.mamba = MambaMixer(_mamba_names(c), dtype, rms_eps=eps, norm_weights=True)
        self.feed_forward = SparseMoe(c, dtype) if num_experts > 1 else MLP(c, dtype)
        self.input_layernorm = RMSNorm(c.hidden_size, eps, dtype)
        self.pre_ff_layernorm = RMSNorm(c.hidden_size, eps, dtype)

    def forward(self, x: torch.Tensor, cache: torch.Tensor, md: Any) -> torch.Tensor:
        h = self.input_layernorm(x)
        h = self.self_attn(h, cache, md) if self.kind == "attention" else self.mamba(h, cache, md)
        x = x + h
        return x + self.feed_forward(self.pre_ff_layernorm(x))


class JambaModel(nn.Module):
    def __init__(self, c: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, dtype)
        self.layers = nn.ModuleList(JambaLayer(c, kind, n, attn_backend, dtype)
                                    for kind, n in zip(c.layers_block_type, c.layers_num_experts))
        self.final_layernorm = RMSNorm(c.hidden_size, float(c.rms_norm_eps), dtype)

    def forward(self, input_ids: torch.Tensor, caches: list[torch.Tensor], mds: list[Any]) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer, cache, md in zip(self.layers, caches, mds, strict=True):
            x = layer(x, cache, md)
        return self.final_layernorm(x)


_EXPERT = re.compile(r"(.*\.feed_forward\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


class JambaForCausalLM(nn.Module, IsStateful):
    """Engine model for JambaForCausalLM checkpoints (per-expert or stacked expert weights)."""

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = hf_config
        self.dtype = dtype
        self.vocab_size: int = hf_config.vocab_size
        self.model = JambaModel(hf_config, attn_backend, dtype)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head = (self.model.embed_tokens.weight if self.tie_word_embeddings
                        else _param(self.vocab_size, hf_config.hidden_size, dtype=dtype))
        self._ops = current_model_ops()
        self._head_state: dict = {}

    def get_kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec]:
        """Attention layers: paged KV in the cache dtype; Mamba layers: one state row in the model dtype."""
        specs: list[KVCacheSpec] = []
        for layer in self.model.layers:
            if layer.kind == "attention":
                a = layer.self_attn
                specs.append(FullAttentionSpec(block_size, a.num_kv_heads, a.head_size, dtype))
            else:
                specs.append(StateSpec.of(block_size, layer.mamba.state_shapes, self.dtype))
        return specs

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: list[Any]) -> torch.Tensor:
        return self.model(input_ids, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self._ops.linear(hidden_states, self.lm_head, None, self._head_state).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters(remove_duplicate=False))
        inter = self.config.intermediate_size
        loaded: set[str] = set()
        shards: dict[str, int] = {}  # stacked expert parameter -> expert shards copied
        unexpected: list[str] = []
        for hf_name, tensor in weights:
            name = "lm_head" if hf_name == "lm_head.weight" else hf_name
            if name == "lm_head" and self.tie_word_embeddings:
                continue
            m = _EXPERT.match(name)
            if m:
                prefix, e, part = m.group(1), int(m.group(2)), m.group(3)
                target = f"{prefix}.{'down_proj' if part == 'down' else 'gate_up_proj'}"
                rows = {"gate": slice(0, inter), "up": slice(inter, 2 * inter), "down": slice(None)}[part]
                dst = params[target].data[e][rows]
                name = target
            elif name in params:
                dst = params[name].data
            else:
                unexpected.append(hf_name)
                continue
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {hf_name}: checkpoint shape {tuple(tensor.shape)} does not match the "
                                 f"model's {tuple(dst.shape)}")
            dst.copy_(tensor)
            if m:
                shards[name] = shards.get(name, 0) + 1
                per_expert = 1 if name.endswith("down_proj") else 2
                if shards[name] == per_expert * self.config.num_experts:
                    loaded.add(name)
            else:
                loaded.add(name)
        if unexpected:
            raise ValueError(f"checkpoint has weights this model does not know: {', '.join(unexpected[:8])}")
        if self.tie_word_embeddings and "model.embed_tokens.weight" in loaded:
            loaded.add("lm_head")
        return loaded
