"""BERT encoders written for the engine: ``BertModel`` (sentence embeddings, e.g. all-MiniLM-L6-v2) and
``BertForSequenceClassification`` (cross-encoders for ``score`` / rerank).

Every token attends to the whole prompt (no causal mask), so a prompt runs in one step (the engine turns
chunked prefill and prefix caching off for it) and no K/V is kept: attention works on the step's own
packed q/k/v (``ModelOps.encoder_attention``: the platform's kernel, or torch's SDPA over padded buckets).
The residual add + LayerNorm and the intermediate layer's GELU go through ``ModelOps`` too, so a platform
can fuse them. Absolute position and token type embeddings, post-LN residual blocks, as in transformers.
Token type ids arrive in the prompt ids' high bits (``vllite_core.pooling.token_types``).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model_registry.layers import (
    ColumnParallelLinear,
    Embedding,
    LayerNorm,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    ShardsByHeads,
    copy_checked,
    load_parameter,
)
from vllite_core.attention.backend import AttentionBackend, AttentionMetadata
from vllite_core.attention.encoder import PackedPrompts
from vllite_core.core.kv_cache_spec import FullAttentionSpec, KVCacheSpec
from vllite_core.model_interfaces import IsPooling
from vllite_core.model_ops import current_model_ops
from vllite_core.pooling.pooler import pool_tokens
from vllite_core.pooling.token_types import split_token_types

_IGNORED = ("embeddings.position_ids",)


class PostLayerNorm(LayerNorm):
    """BERT's post-LN residual blocks: ``add_forward`` lets the platform fuse the residual add into the norm."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__(size, dtype, eps)
        self.ops = current_model_ops()

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``norm(x + residual)``; may reuse ``x``'s storage."""
        return self.ops.add_layer_norm(x, residual, self.weight, self.bias, self.eps)


class BertLayer(nn.Module):
    def __init__(self, c: Any, dtype: torch.dtype) -> None:
        super().__init__()
        h, eps = c.hidden_size, float(c.layer_norm_eps)
        self.head_size = h // c.num_attention_heads
        # Tensor-parallel: this rank's heads (q, k and v of each), the matching columns of the output
        # projection, its slice of the intermediate layer; the two row-parallel layers sum over the ranks.
        self.qkv = QKVParallelLinear(h, self.head_size, c.num_attention_heads, c.num_attention_heads, True, dtype)
        self.num_heads = self.qkv.heads.num_heads
        self.attn_out = RowParallelLinear(h, h, True, dtype, self.qkv.q_cols)
        self.attn_norm = PostLayerNorm(h, eps, dtype)
        self.intermediate = ColumnParallelLinear(h, c.intermediate_size, True, dtype)
        self.out = RowParallelLinear(c.intermediate_size, h, True, dtype)
        self.out_norm = PostLayerNorm(h, eps, dtype)
        act = getattr(c, "hidden_act", "gelu")
        if act not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
            raise NotImplementedError(f"hidden_act {act!r} is not supported by the BERT implementation")
        self.approximate = "none" if act == "gelu" else "tanh"
        self._ops = current_model_ops()

    def forward(self, x: torch.Tensor, prompts: PackedPrompts) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv(x).view(t, 3, self.num_heads, self.head_size)
        ctx = self._ops.encoder_attention(qkv, prompts, self.head_size ** -0.5).reshape(t, -1)
        x = self.attn_norm.add_forward(self.attn_out(ctx), x)
        if self.approximate == "none":
            mid = self._ops.linear_gelu(x, self.intermediate.weight, self.intermediate.bias, self.intermediate.state)
        else:
            mid = F.gelu(self.intermediate(x), approximate=self.approximate)
        return self.out_norm.add_forward(self.out(mid), x)


class BertModel(nn.Module, ShardsByHeads, IsPooling):
    """Sentence embeddings: CLS pooling by default; a sentence-transformers folder says mean / last and
    whether to normalise (``vllite_core.pooling.config``). Tensor-parallel over its heads and intermediate
    width; the embeddings, norms and heads stay whole on every rank."""

    pooling_task = "embed"
    default_pooling_type = "CLS"
    is_bidirectional = True
    weight_prefix = "bert."  # the encoder's tensors in a checkpoint with a head

    def position_offset(self) -> int:
        """Added to each token's position before its embedding (RoBERTa starts after its padding index)."""
        return 0

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        c = hf_config
        if getattr(c, "position_embedding_type", "absolute") != "absolute":
            raise NotImplementedError(f"position_embedding_type {c.position_embedding_type!r} is not supported")
        self.config, self.dtype = c, dtype
        self.vocab_size: int = c.vocab_size
        self.hidden_size: int = c.hidden_size
        self.word_embeddings = Embedding(c.vocab_size, c.hidden_size, dtype)
        self.position_embeddings = Embedding(c.max_position_embeddings, c.hidden_size, dtype)
        self.token_type_embeddings = Embedding(max(1, c.type_vocab_size), c.hidden_size, dtype)
        self.embed_norm = LayerNorm(c.hidden_size, dtype, float(c.layer_norm_eps))
        self.layers = nn.ModuleList(BertLayer(c, dtype) for _ in range(c.num_hidden_layers))

    def get_kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec]:
        """No K/V is kept; one minimal layer (1 head of 1 value) keeps the scheduler's block accounting."""
        return [FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=dtype)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: list[AttentionMetadata]) -> torch.Tensor:
        """Final hidden states [T, hidden] of every request's prompt (each whole in this step)."""
        ids, types = split_token_types(input_ids)
        x = self.word_embeddings(ids) + self.position_embeddings(positions + self.position_offset()) \
            + self.token_type_embeddings(types)
        x = self.embed_norm(x)
        prompts = PackedPrompts(attn_metadata[0].query_start_loc_cpu, x.device)
        for layer in self.layers:
            x = layer(x, prompts)
        return x

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states.float()

    def pool(self, hidden: list[torch.Tensor], cfg: Any) -> list[torch.Tensor]:
        return [pool_tokens(h, cfg.pooling_type) for h in hidden]

    # ---- weights -------------------------------------------------------------------------------
    def _target(self, name: str) -> tuple[str, str | None] | None:
        """The parameter (and shard of a fused one: q, k, v) an HF BERT tensor fills; None: not part of
        this model."""
        name = name.removeprefix(self.weight_prefix)
        if name.startswith("embeddings."):
            rest = name.removeprefix("embeddings.")
            return {"word_embeddings.weight": ("word_embeddings.weight", None),
                    "position_embeddings.weight": ("position_embeddings.weight", None),
                    "token_type_embeddings.weight": ("token_type_embeddings.weight", None),
                    "LayerNorm.weight": ("embed_norm.weight", None),
                    "LayerNorm.bias": ("embed_norm.bias", None)}.get(rest)
        if not name.startswith("encoder.layer."):
            return None
        idx, rest = name.removeprefix("encoder.layer.").split(".", 1)
        for part in ("query", "key", "value"):
            if rest.startswith(f"attention.self.{part}."):
                return f"layers.{idx}.qkv.{rest.rsplit('.', 1)[1]}", part[0]
        mapped = {"attention.output.dense": "attn_out", "attention.output.LayerNorm": "attn_norm",
                  "intermediate.dense": "intermediate", "output.dense": "out", "output.LayerNorm": "out_norm"}
        module, leaf = rest.rsplit(".", 1)
        return (f"layers.{idx}.{mapped[module]}.{leaf}", None) if module in mapped else None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        fused_seen: dict[str, int] = {}
        unexpected = []
        for hf_name, tensor in weights:
            if hf_name.endswith(_IGNORED):
                continue
            target = self._target(hf_name)
            if target is None:
                if not self._extra_weight(hf_name, tensor, params, loaded):
                    unexpected.append(hf_name)
                continue
            name, shard = target
            load_parameter(params[name], tensor, shard, hf_name)  # this rank's slice
            if shard is None:
                loaded.add(name)
            else:
                fused_seen[name] = fused_seen.get(name, 0) + 1
                if fused_seen[name] == 3:
                    loaded.add(name)
        if unexpected:
            raise ValueError(f"checkpoint has weights this model does not know: {', '.join(unexpected[:8])}")
        return loaded

    def _extra_weight(self, name: str, tensor: torch.Tensor, params: dict, loaded: set[str]) -> bool:
        """Weights outside the encoder: the unused pooler of a plain BertModel checkpoint is skipped."""
        return name.removeprefix(self.weight_prefix).startswith("pooler.")


class BertForSequenceClassification(BertModel):
    """Cross-encoder / classifier: CLS -> pooler (dense, tanh) -> classifier, as transformers computes it."""

    pooling_task = "classify"
    default_pooling_type = "CLS"

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__(hf_config, attn_backend, dtype)
        h = hf_config.hidden_size
        self.num_labels = int(hf_config.num_labels)
        self.pooler = ReplicatedLinear(h, h, True, dtype)
        self.classifier = ReplicatedLinear(h, self.num_labels, True, dtype)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.tanh(self.pooler(hidden_states))).float()

    def pool(self, hidden: list[torch.Tensor], cfg: Any) -> list[torch.Tensor]:
        pooled = torch.stack([pool_tokens(h, cfg.pooling_type) for h in hidden])
        return list(self.compute_logits(pooled))

    head_weights = {"pooler.dense.weight": "pooler.weight", "pooler.dense.bias": "pooler.bias",
                    "classifier.weight": "classifier.weight", "classifier.bias": "classifier.bias"}

    def _extra_weight(self, name: str, tensor: torch.Tensor, params: dict, loaded: set[str]) -> bool:
        name = name.removeprefix(self.weight_prefix)
        target = self.head_weights.get(name)
        if target is None:
            return False
        copy_checked(params[target].data, tensor, name)
        loaded.add(target)
        return True
