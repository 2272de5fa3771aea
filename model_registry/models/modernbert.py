"""ModernBERT encoders (``ModernBertModel`` embeddings such as gte-modernbert, and
``ModernBertForSequenceClassification`` rerankers): pre-norm blocks (the first layer's attention norm is the
identity), fused ``Wqkv`` and GeGLU ``Wi``, rotary positions, and attention that alternates between global
layers and local ones where a token sees only tokens within ``local_attention / 2`` of it (both sides;
every ``global_attn_every_n_layers``-th layer is global, each kind with its own rope base), all without
padding: each prompt is its own rows of the step, as in the engine's other encoders (``bert``)."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model_registry.layers import (
    Embedding,
    LayerNorm,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RotaryEmbedding,
    RowParallelLinear,
    ShardsByHeads,
    apply_rotary,
    gated,
)
from model_registry.layers.activation import get_act_fn
from model_registry.layers.params import load_by_name
from vllite_core.attention.backend import AttentionBackend, AttentionMetadata
from vllite_core.attention.encoder import PackedPrompts
from vllite_core.core.kv_cache_spec import FullAttentionSpec, KVCacheSpec
from vllite_core.model_interfaces import IsPooling
from vllite_core.model_ops import current_model_ops
from vllite_core.pooling.pooler import pool_tokens
from vllite_core.pooling.token_types import split_token_types


def local_attention(qkv: torch.Tensor, prompts: PackedPrompts, scale: float, half_window: int) -> torch.Tensor:
    """Bidirectional attention within ``|i - j| <= half_window`` of each prompt's rows; ``qkv`` [T, 3, H, D]."""
    out = torch.empty_like(qkv[:, 0])
    for a, b in zip(prompts.starts[:-1], prompts.starts[1:]):
        if b <= a:
            continue
        q, k, v = (t.transpose(0, 1) for t in qkv[a:b].unbind(1))
        idx = torch.arange(b - a, device=qkv.device)
        band = (idx[:, None] - idx[None, :]).abs() <= half_window
        out[a:b] = F.scaled_dot_product_attention(q, k, v, attn_mask=band, scale=scale).transpose(0, 1)
    return out


class ModernBertLayer(nn.Module):
    def __init__(self, c: Any, index: int, dtype: torch.dtype) -> None:
        super().__init__()
        h, eps, bias = c.hidden_size, float(c.norm_eps), bool(c.norm_bias)
        self.head_size = h // c.num_attention_heads
        self.kind = c.layer_types[index]
        self.half_window = int(c.local_attention) // 2 if self.kind == "sliding_attention" else None
        self.attn_norm = LayerNorm(h, dtype, eps, bias) if index > 0 else None
        # Tensor-parallel as BERT's layer: this rank's heads, its slice of the GeGLU's input and gate rows.
        self.Wqkv = QKVParallelLinear(h, self.head_size, c.num_attention_heads, c.num_attention_heads,
                                      bool(c.attention_bias), dtype)
        self.heads = self.Wqkv.heads.num_heads
        self.Wo = RowParallelLinear(h, h, bool(c.attention_bias), dtype, self.Wqkv.q_cols)
        self.mlp_norm = LayerNorm(h, dtype, eps, bias)
        inter = int(c.intermediate_size)
        self.Wi = MergedColumnParallelLinear(h, {"input": inter, "gate": inter}, bool(c.mlp_bias), dtype)
        self.mlp_Wo = RowParallelLinear(inter, h, bool(c.mlp_bias), dtype)
        self.act = str(c.hidden_activation)
        self.ops = current_model_ops()

    def forward(self, x: torch.Tensor, prompts: PackedPrompts, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.Wqkv(self.attn_norm(x) if self.attn_norm is not None else x).view(t, 3, self.heads, self.head_size)
        q, k = apply_rotary(self.ops, qkv[:, 0], qkv[:, 1], *rope)
        qkv = torch.stack((q, k, qkv[:, 2]), dim=1)
        scale = self.head_size ** -0.5
        if self.half_window is None:
            ctx = self.ops.encoder_attention(qkv, prompts, scale)
        else:
            ctx = local_attention(qkv, prompts, scale, self.half_window)
        x = x + self.Wo(ctx.reshape(t, -1))
        return x + self.mlp_Wo(gated(self.act, self.Wi(self.mlp_norm(x))))


class ModernBertModel(nn.Module, ShardsByHeads, IsPooling):
    """Tensor-parallel over its heads and MLP width; embeddings, norms and the head whole on every rank."""

    pooling_task = "embed"
    default_pooling_type = "CLS"
    is_bidirectional = True

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        c = hf_config
        self.config, self.dtype = c, dtype
        self.vocab_size: int = c.vocab_size
        self.hidden_size: int = c.hidden_size
        eps, bias = float(c.norm_eps), bool(c.norm_bias)
        self.tok_embeddings = Embedding(c.vocab_size, c.hidden_size, dtype)
        self.embed_norm = LayerNorm(c.hidden_size, dtype, eps, bias)
        self.layers = nn.ModuleList(ModernBertLayer(c, i, dtype) for i in range(c.num_hidden_layers))
        self.final_norm = LayerNorm(c.hidden_size, dtype, eps, bias)
        head = c.hidden_size // c.num_attention_heads
        bases = {kind: float(p["rope_theta"]) for kind, p in c.rope_parameters.items()}
        self.rotary = nn.ModuleDict({kind: RotaryEmbedding(c, head, base=base) for kind, base in bases.items()})

    def get_kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec]:
        """No K/V is kept (every prompt runs whole in one step); one minimal layer for the block accounting."""
        return [FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=dtype)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: list[AttentionMetadata]) -> torch.Tensor:
        ids, _ = split_token_types(input_ids)  # no token type embeddings in ModernBERT
        x = self.embed_norm(self.tok_embeddings(ids))
        prompts = PackedPrompts(attn_metadata[0].query_start_loc_cpu, x.device)
        ropes = {kind: r.lookup(positions, x.dtype) for kind, r in self.rotary.items()}
        for layer in self.layers:
            x = layer(x, prompts, ropes[layer.kind])
        return self.final_norm(x)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states.float()

    def pool(self, hidden: list[torch.Tensor], cfg: Any) -> list[torch.Tensor]:
        return [pool_tokens(h, cfg.pooling_type) for h in hidden]

    _RENAMES = (("embeddings.tok_embeddings.", "tok_embeddings."), ("embeddings.norm.", "embed_norm."),
                (".attn.Wqkv.", ".Wqkv."), (".attn.Wo.", ".Wo."), (".mlp.Wi.", ".Wi."), (".mlp.Wo.", ".mlp_Wo."))

    def _rename(self, name: str) -> str | None:
        name = name.removeprefix("model.")
        for old, new in self._RENAMES:
            name = name.replace(old, new)
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_by_name(self, weights, self._rename)


class ModernBertForSequenceClassification(ModernBertModel):
    """Pooled state (``classifier_pooling``: cls or mean) -> head (dense, activation, norm) -> classifier."""

    pooling_task = "classify"

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__(hf_config, attn_backend, dtype)
        c = hf_config
        self.head_pooling = "MEAN" if c.classifier_pooling == "mean" else "CLS"  # fixed by the checkpoint
        self.head_dense = ReplicatedLinear(c.hidden_size, c.hidden_size, bool(c.classifier_bias), dtype)
        self.head_norm = LayerNorm(c.hidden_size, dtype, float(c.norm_eps), bool(c.norm_bias))
        self.head_act = get_act_fn(str(c.classifier_activation))
        self.classifier = ReplicatedLinear(c.hidden_size, int(c.num_labels), True, dtype)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.head_norm(self.head_act(self.head_dense(hidden_states)))).float()

    def pool(self, hidden: list[torch.Tensor], cfg: Any) -> list[torch.Tensor]:
        return list(self.compute_logits(torch.stack([pool_tokens(h, self.head_pooling) for h in hidden])))

    def _rename(self, name: str) -> str | None:
        if name.startswith("head."):
            return "head_" + name.removeprefix("head.")
        return super()._rename(name)
