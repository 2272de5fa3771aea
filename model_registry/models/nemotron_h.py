"""NemotronH (NemotronHForCausalLM): a stack of single-mixer blocks chosen by ``hybrid_override_pattern``
(``M`` Mamba-2, ``*`` attention without positional encoding, ``-`` an MLP), each ``x + mixer(norm(x))``.

Mamba-2 blocks hold a state (``StateSpec``), attention blocks paged KV; MLP blocks hold no cache, so the
model's ``kv_caches`` list covers the cache-holding blocks only, in order. Module names follow the HF
checkpoint's (``backbone.*``).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from model_registry.layers import ReplicatedLinear, RMSNorm
from model_registry.models.hf_weights import load_by_name
from model_registry.models.jamba import Attention
from model_registry.models.mamba import Embedding, _param
from model_registry.models.mamba2 import Mamba2Dims, Mamba2Mixer
from vllite_core.attention.backend import AttentionBackend
from vllite_core.core.kv_cache_spec import FullAttentionSpec, KVCacheSpec, StateSpec
from vllite_core.model_interfaces import IsStateful
from vllite_core.model_ops import current_model_ops


class ReluSquaredMLP(nn.Module):
    def __init__(self, c: Any, dtype: torch.dtype) -> None:
        super().__init__()
        if c.mlp_hidden_act != "relu2":
            raise NotImplementedError(f"NemotronH mlp_hidden_act {c.mlp_hidden_act!r} (relu2 only)")
        self.up_proj = ReplicatedLinear(c.hidden_size, c.intermediate_size, bool(c.mlp_bias), dtype)
        self.down_proj = ReplicatedLinear(c.intermediate_size, c.hidden_size, bool(c.mlp_bias), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)).square())


def _dims(c: Any) -> Mamba2Dims:
    return Mamba2Dims(hidden_size=c.hidden_size, num_heads=c.mamba_num_heads, head_dim=c.mamba_head_dim,
                      n_groups=c.n_groups, state_size=c.ssm_state_size, conv_kernel=c.conv_kernel,
                      chunk_size=c.chunk_size, use_bias=bool(c.use_bias), use_conv_bias=bool(c.use_conv_bias),
                      norm_eps=float(c.layer_norm_epsilon), dt_limit=(float(c.time_step_min), float("inf")),
                      activation=c.mamba_hidden_act)


class NemotronHBlock(nn.Module):
    def __init__(self, c: Any, kind: str, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(c.hidden_size, float(c.layer_norm_epsilon), dtype)
        if kind == "linear_attention":
            self.mixer: nn.Module = Mamba2Mixer(_dims(c), dtype)
        elif kind == "full_attention":
            self.mixer = Attention(c, attn_backend, dtype)
        elif kind == "mlp":
            self.mixer = ReluSquaredMLP(c, dtype)
        else:
            raise NotImplementedError(f"NemotronH block type {kind!r} is not supported (mamba, attention, mlp)")

    @property
    def holds_cache(self) -> bool:
        return self.kind != "mlp"

    def forward(self, x: torch.Tensor, cache: torch.Tensor | None, md: Any) -> torch.Tensor:
        h = self.norm(x)
        return x + (self.mixer(h) if self.kind == "mlp" else self.mixer(h, cache, md))


class NemotronHForCausalLM(nn.Module, IsStateful):
    """Engine model for NemotronHForCausalLM checkpoints."""

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        c = hf_config
        self.config = c
        self.dtype = dtype
        self.vocab_size: int = c.vocab_size
        self.backbone = nn.Module()
        self.backbone.embeddings = Embedding(c.vocab_size, c.hidden_size, dtype)
        self.backbone.layers = nn.ModuleList(NemotronHBlock(c, kind, attn_backend, dtype)
                                             for kind in c.layers_block_type)
        self.backbone.norm_f = RMSNorm(c.hidden_size, float(c.layer_norm_epsilon), dtype)
        self.tie_word_embeddings = bool(getattr(c, "tie_word_embeddings", False))
        self.lm_head = (self.backbone.embeddings.weight if self.tie_word_embeddings
                        else _param(self.vocab_size, c.hidden_size, dtype=dtype))
        self._ops = current_model_ops()
        self._head_state: dict = {}

    def get_kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec]:
        specs: list[KVCacheSpec] = []
        for block in self.backbone.layers:
            if block.kind == "linear_attention":
                specs.append(StateSpec.of(block_size, block.mixer.state_shapes, self.dtype))
            elif block.kind == "full_attention":
                specs.append(FullAttentionSpec(block_size, block.mixer.num_kv_heads, block.mixer.head_size, dtype))
        return specs

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: list[Any]) -> torch.Tensor:
        x = self.backbone.embeddings(input_ids)
        i = 0
        for block in self.backbone.layers:
            if block.holds_cache:
                x = block(x, kv_caches[i], attn_metadata[i])
                i += 1
            else:
                x = block(x, None, None)
        return self.backbone.norm_f(x)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self._ops.linear(hidden_states, self.lm_head, None, self._head_state).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def rename(name: str) -> str | None:
            if name == "lm_head.weight":
                return None if self.tie_word_embeddings else "lm_head"
            return name

        loaded = load_by_name(self, weights, rename)
        if self.tie_word_embeddings and "backbone.embeddings.weight" in loaded:
            loaded.add("lm_head")
        return loaded
