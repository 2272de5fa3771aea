"""Falcon-H1 (FalconH1ForCausalLM): every layer runs a Mamba-2 mixer and RoPE attention side by side on the
same normalised input and adds both, then a SwiGLU MLP; muP multipliers scale the embeddings, the
mixer's projections (per section of ``in_proj``), keys, branch outputs, the MLP and the logits.

So each layer holds two caches: a state (``StateSpec``) and paged KV (``FullAttentionSpec``); the
model's ``kv_caches`` lists, per layer, the state then the KV cache. Module names follow the HF
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
from model_registry.models.hf_weights import load_by_name
from model_registry.models.mamba import Conv1d, Embedding, _param
from model_registry.models.mamba2 import Mamba2Dims
from vllite_core.attention.backend import AttentionBackend
from vllite_core.core.kv_cache_spec import FullAttentionSpec, KVCacheSpec, StateSpec
from vllite_core.model_interfaces import IsStateful
from vllite_core.model_ops import current_model_ops
from vllite_core.state_cache import StateMetadata, gather_states, scatter_states


class GroupedGatedNorm(nn.Module):
    """Falcon-H1's gated RMS norm: per group of channels, in float32, the weight applied before the cast;
    the silu(gate) factor before the norm or after it (``norm_before_gate``)."""

    def __init__(self, size: int, n_groups: int, eps: float, norm_before_gate: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(size, dtype=dtype)
        self.n_groups, self.eps, self.norm_before_gate = n_groups, eps, norm_before_gate

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        if not self.norm_before_gate:
            h = h * F.silu(gate.float())
        g = h.view(*h.shape[:-1], self.n_groups, -1)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        h = (self.weight.view(self.n_groups, -1) * g).view(h.shape)
        if self.norm_before_gate:
            h = h * F.silu(gate.float())
        return h.to(x.dtype)


def _mup_vector(c: Any, d: Mamba2Dims) -> torch.Tensor:
    """One multiplier per ``in_proj`` output: the gate, x, B, C and dt sections each get theirs."""
    gn = d.n_groups * d.state_size
    sizes = [d.intermediate, d.intermediate, gn, gn, d.num_heads]
    return torch.cat([torch.full((n,), float(m)) for n, m in zip(sizes, c.ssm_multipliers, strict=True)])


class FalconH1Mixer(nn.Module):
    def __init__(self, c: Any, dtype: torch.dtype) -> None:
        super().__init__()
        d = Mamba2Dims(hidden_size=c.hidden_size, num_heads=c.mamba_n_heads, head_dim=c.mamba_d_head,
                       n_groups=c.mamba_n_groups, state_size=c.mamba_d_state, conv_kernel=c.mamba_d_conv,
                       chunk_size=c.mamba_chunk_size, use_bias=bool(c.mamba_proj_bias),
                       use_conv_bias=bool(c.mamba_conv_bias), norm_eps=float(c.rms_norm_eps),
                       dt_limit=tuple(c.time_step_limit), activation=c.hidden_act)
        self.d = d
        self.in_proj = ReplicatedLinear(d.hidden_size, d.intermediate + d.conv_dim + d.num_heads, d.use_bias, dtype)
        self.conv1d = Conv1d(d.conv_dim, d.conv_kernel, d.use_conv_bias, dtype)
        self.dt_bias = _param(d.num_heads, dtype=dtype)
        self.A_log = _param(d.num_heads, dtype=dtype)
        self.D = _param(d.num_heads, dtype=dtype)
        self.norm = (GroupedGatedNorm(d.intermediate, d.n_groups, d.norm_eps, bool(c.mamba_norm_before_gate), dtype)
                     if c.mamba_rms_norm else None)
        self.out_proj = ReplicatedLinear(d.intermediate, d.hidden_size, bool(c.projectors_bias), dtype)
        self.register_buffer("mup_vector", _mup_vector(c, d).to(dtype), persistent=False)
        self.in_multiplier = float(c.ssm_in_multiplier)
        self._ops = current_model_ops()

    @property
    def state_shapes(self) -> list[tuple[int, ...]]:
        d = self.d
        return [(d.conv_dim, d.conv_kernel - 1), (d.num_heads, d.head_dim, d.state_size)]

    def forward(self, x: torch.Tensor, cache: torch.Tensor, md: StateMetadata) -> torch.Tensor:
        d, ops, qsl = self.d, self._ops, md.query_start_loc_cpu
        states = gather_states(cache, md, tuple(self.state_shapes))
        conv_state, ssm_state = states
        proj = self.in_proj(x * self.in_multiplier) * self.mup_vector
        gate, xbc, dt = proj.split([d.intermediate, d.conv_dim, d.num_heads], dim=-1)
        xbc = ops.causal_conv1d(xbc.contiguous(), self.conv1d.weight[:, 0, :], self.conv1d.bias, conv_state, qsl,
                                d.activation)
        gn = d.n_groups * d.state_size
        xs, B, C = xbc.split([d.intermediate, gn, gn], dim=-1)
        t = x.shape[0]
        y = ops.ssd_scan(xs.reshape(t, d.num_heads, d.head_dim), dt, -torch.exp(self.A_log.float()),
                         B.reshape(t, d.n_groups, d.state_size), C.reshape(t, d.n_groups, d.state_size), self.D,
                         self.dt_bias, d.dt_limit, d.chunk_size, ssm_state, qsl)
        scatter_states(cache, md, states)
        y = y.reshape(t, d.intermediate).to(x.dtype)
        y = self.norm(y, gate) if self.norm is not None else y * F.silu(gate)
        return self.out_proj(y)


class Attention(nn.Module):
    def __init__(self, c: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = c.num_attention_heads
        self.num_kv_heads = c.num_key_value_heads
        self.head_size = getattr(c, "head_dim", None) or c.hidden_size // self.num_heads
        bias = bool(c.attention_bias)
        self.q_proj = ReplicatedLinear(c.hidden_size, self.num_heads * self.head_size, bias, dtype)
        self.k_proj = ReplicatedLinear(c.hidden_size, self.num_kv_heads * self.head_size, bias, dtype)
        self.v_proj = ReplicatedLinear(c.hidden_size, self.num_kv_heads * self.head_size, bias, dtype)
        self.o_proj = ReplicatedLinear(self.num_heads * self.head_size, c.hidden_size, bias, dtype)
        self.key_multiplier = float(c.key_multiplier)
        self.attn_backend = attn_backend
        self._ops = current_model_ops()

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, kv_cache: torch.Tensor,
                md: Any) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_size)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_size) * self.key_multiplier
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_size)
        q, k = self._ops.rotary(q, k, *rope)
        out = self.attn_backend.forward(q, k, v, kv_cache, md, self.head_size ** -0.5)
        return self.o_proj(out.reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, c: Any, dtype: torch.dtype) -> None:
        super().__init__()
        bias = bool(c.mlp_bias)
        self.gate_proj = ReplicatedLinear(c.hidden_size, c.intermediate_size, bias, dtype)
        self.up_proj = ReplicatedLinear(c.hidden_size, c.intermediate_size, bias, dtype)
        self.down_proj = ReplicatedLinear(c.intermediate_size, c.hidden_size, bias, dtype)
        self.gate_multiplier, self.down_multiplier = (float(m) for m in c.mlp_multipliers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.up_proj(x) * F.silu(self.gate_proj(x) * self.gate_multiplier)
        return self.down_proj(y) * self.down_multiplier


class FalconH1Layer(nn.Module):
    def __init__(self, c: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        eps = float(c.rms_norm_eps)
        self.mamba = FalconH1Mixer(c, dtype)
        self.self_attn = Attention(c, attn_backend, dtype)
        self.feed_forward = MLP(c, dtype)
        self.input_layernorm = RMSNorm(c.hidden_size, eps, dtype)
        self.pre_ff_layernorm = RMSNorm(c.hidden_size, eps, dtype)
        self.attention_in_multiplier = float(c.attention_in_multiplier)
        self.ssm_out_multiplier = float(c.ssm_out_multiplier)
        self.attention_out_multiplier = float(c.attention_out_multiplier)

    def forward(self, rope: Any, x: torch.Tensor, caches: tuple[torch.Tensor, torch.Tensor],
                mds: tuple[Any, Any]) -> torch.Tensor:
        h = self.input_layernorm(x)
        m = self.mamba(h, caches[0], mds[0]) * self.ssm_out_multiplier
        a = self.self_attn(rope, h * self.attention_in_multiplier, caches[1], mds[1]) * self.attention_out_multiplier
        x = x + (m + a)
        return x + self.feed_forward(self.pre_ff_layernorm(x))


class FalconH1ForCausalLM(nn.Module, IsStateful):
    """Engine model for FalconH1ForCausalLM checkpoints."""

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        c = hf_config
        self.config = c
        self.dtype = dtype
        self.vocab_size: int = c.vocab_size
        self.model = nn.Module()
        self.model.embed_tokens = Embedding(c.vocab_size, c.hidden_size, dtype)
        self.model.layers = nn.ModuleList(FalconH1Layer(c, attn_backend, dtype) for _ in range(c.num_hidden_layers))
        self.model.final_layernorm = RMSNorm(c.hidden_size, float(c.rms_norm_eps), dtype)
        self.rotary_emb = RotaryEmbedding(c, self.model.layers[0].self_attn.head_size)
        self.embedding_multiplier = float(c.embedding_multiplier)
        self.lm_head_multiplier = float(c.lm_head_multiplier)
        self.tie_word_embeddings = bool(getattr(c, "tie_word_embeddings", False))
        self.lm_head = (self.model.embed_tokens.weight if self.tie_word_embeddings
                        else _param(self.vocab_size, c.hidden_size, dtype=dtype))
        self._ops = current_model_ops()
        self._head_state: dict = {}

    def get_kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec]:
        """Per layer: its Mamba state, then its attention KV."""
        specs: list[KVCacheSpec] = []
        for layer in self.model.layers:
            a = layer.self_attn
            specs.append(StateSpec.of(block_size, layer.mamba.state_shapes, self.dtype))
            specs.append(FullAttentionSpec(block_size, a.num_kv_heads, a.head_size, dtype))
        return specs

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: list[Any]) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids) * self.embedding_multiplier
        rope = self.rotary_emb.lookup(positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(rope, x, (kv_caches[2 * i], kv_caches[2 * i + 1]),
                      (attn_metadata[2 * i], attn_metadata[2 * i + 1]))
        return self.model.final_layernorm(x)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self._ops.linear(hidden_states, self.lm_head, None, self._head_state).float()
        return logits * self.lm_head_multiplier

    def ensure_positions(self, max_model_len: int) -> None:
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
