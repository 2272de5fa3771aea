"""BERT-shaped encoders with rotary positions and a gated MLP: ``GteModel`` / ``GteForSequenceClassification``
(gte-multilingual, Alibaba's ``NewModel`` layout as transformers names it) and ``NomicBertModel``
(nomic-embed-text). Word (+ token type) embeddings and a LayerNorm, no absolute positions; post-LN blocks of
fused-qkv attention with rotary positions over the whole prompt and ``down(act(gate(x)) * up(x))``.

Checkpoints name the tensors as the original remote code did (transformers converts them on load and back on
save): GTE's ``attention.qkv_proj``, ``mlp.up_gate_proj`` (up rows first), ``attn_ln`` / ``mlp_ln``; Nomic's
``attn.Wqkv``, ``fc11`` (up) / ``fc12`` (gate) / ``fc2``, ``norm1`` / ``norm2``, ``emb_ln``."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from model_registry.layers import (
    ColumnParallelLinear,
    Embedding,
    LayerNorm,
    QKVParallelLinear,
    ReplicatedLinear,
    RotaryEmbedding,
    RowParallelLinear,
    ShardsByHeads,
    apply_rotary,
    load_parameter,
)
from model_registry.layers.activation import get_act_fn
from model_registry.models.bert import PostLayerNorm
from vllite_core.attention.backend import AttentionBackend, AttentionMetadata
from vllite_core.attention.encoder import PackedPrompts
from vllite_core.core.kv_cache_spec import FullAttentionSpec, KVCacheSpec
from vllite_core.model_interfaces import IsPooling
from vllite_core.model_ops import current_model_ops
from vllite_core.pooling.pooler import pool_tokens
from vllite_core.pooling.token_types import split_token_types


class RopeBertLayer(nn.Module):
    def __init__(self, c: Any, bias: bool, down_bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        h, eps = c.hidden_size, float(c.layer_norm_eps)
        heads = c.num_attention_heads
        self.head_size = int(getattr(c, "head_dim", None) or h // heads)
        # Tensor-parallel as BERT's layer: this rank's heads and MLP slice, two row-parallel sums per layer.
        self.qkv = QKVParallelLinear(h, self.head_size, heads, heads, bias, dtype)
        self.heads = self.qkv.heads.num_heads
        self.o = RowParallelLinear(heads * self.head_size, h, bias, dtype, self.qkv.q_cols)
        self.attn_norm = PostLayerNorm(h, eps, dtype)
        self.gate = ColumnParallelLinear(h, c.intermediate_size, False, dtype)
        self.up = ColumnParallelLinear(h, c.intermediate_size, False, dtype)
        self.down = RowParallelLinear(c.intermediate_size, h, down_bias, dtype)
        self.mlp_norm = PostLayerNorm(h, eps, dtype)
        self.act = get_act_fn(str(c.hidden_act))
        self.ops = current_model_ops()

    def forward(self, x: torch.Tensor, prompts: PackedPrompts, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv(x).view(t, 3, self.heads, self.head_size)
        q, k = apply_rotary(self.ops, qkv[:, 0], qkv[:, 1], *rope)
        ctx = self.ops.encoder_attention(torch.stack((q, k, qkv[:, 2]), dim=1), prompts, self.head_size ** -0.5)
        x = self.attn_norm.add_forward(self.o(ctx.reshape(t, -1)), x)
        return self.mlp_norm.add_forward(self.down(self.act(self.gate(x)) * self.up(x)), x)


class GteModel(nn.Module, ShardsByHeads, IsPooling):
    """gte-multilingual embeddings: CLS pooling unless a sentence-transformers folder says otherwise.
    Tensor-parallel over its heads and MLP width; embeddings, norms and heads whole on every rank."""

    pooling_task = "embed"
    default_pooling_type = "CLS"
    is_bidirectional = True
    attn_bias, down_bias = True, True
    prefixes: tuple[str, ...] = ("gte.", "new.")
    # checkpoint name fragment -> parameter name fragment (GTE's original names)
    renames: tuple[tuple[str, str], ...] = (
        ("embeddings.LayerNorm.", "embed_norm."), ("embeddings.", ""), ("encoder.layer.", "layers."),
        (".attention.qkv_proj.", ".qkv."), (".attention.o_proj.", ".o."), (".attn_ln.", ".attn_norm."),
        (".mlp.down_proj.", ".down."), (".mlp_ln.", ".mlp_norm."))

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        c = hf_config
        self.config, self.dtype = c, dtype
        self.vocab_size: int = c.vocab_size
        self.hidden_size: int = c.hidden_size
        self.word_embeddings = Embedding(c.vocab_size, c.hidden_size, dtype)
        types = int(c.type_vocab_size or 0)
        self.token_type_embeddings = Embedding(types, c.hidden_size, dtype) if types else None
        self.embed_norm = LayerNorm(c.hidden_size, dtype, float(c.layer_norm_eps))
        self.layers = nn.ModuleList(RopeBertLayer(c, self.attn_bias, self.down_bias, dtype)
                                    for _ in range(c.num_hidden_layers))
        self.rotary = RotaryEmbedding(c, self.layers[0].head_size)

    def get_kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec]:
        """No K/V is kept (every prompt runs whole in one step); one minimal layer for the block accounting."""
        return [FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=dtype)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: list[AttentionMetadata]) -> torch.Tensor:
        ids, types = split_token_types(input_ids)
        x = self.word_embeddings(ids)
        if self.token_type_embeddings is not None:
            x = x + self.token_type_embeddings(types)
        x = self.embed_norm(x)
        prompts = PackedPrompts(attn_metadata[0].query_start_loc_cpu, x.device)
        rope = self.rotary.lookup(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, prompts, rope)
        return x

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states.float()

    def pool(self, hidden: list[torch.Tensor], cfg: Any) -> list[torch.Tensor]:
        return [pool_tokens(h, cfg.pooling_type) for h in hidden]

    def _rename(self, name: str) -> str | None:
        """The parameter a checkpoint tensor fills; None: a tensor this model does not use (an unused pooler)."""
        for p in self.prefixes:
            name = name.removeprefix(p)
        if name.startswith("pooler."):
            return None
        for old, new in self.renames:
            if name.startswith(old) or (old.startswith(".") and old in name):
                name = name.replace(old, new, 1)
        return name

    def _split(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """GTE's fused ``up_gate_proj`` (up rows, then gate rows) into the two projections."""
        if ".mlp.up_gate_proj." in name:
            up, gate = tensor.chunk(2, dim=0)
            fused = ".mlp.up_gate_proj."
            return [(name.replace(fused, ".up."), up), (name.replace(fused, ".gate."), gate)]
        return [(name, tensor)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        unexpected: list[str] = []
        for hf_name, tensor in weights:
            name = self._rename(hf_name)
            if name is None:
                continue
            for target, part in self._split(name, tensor):
                if target not in params:
                    unexpected.append(hf_name)
                    continue
                load_parameter(params[target], part, None, hf_name)  # this rank's slice
                loaded.add(target)
        if unexpected:
            raise ValueError(f"checkpoint has weights this model does not know: {', '.join(unexpected[:8])}")
        return loaded


class GteForSequenceClassification(GteModel):
    """Cross-encoder / classifier: CLS -> pooler (dense, tanh) -> classifier, as BERT's head."""

    pooling_task = "classify"

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__(hf_config, attn_backend, dtype)
        h = hf_config.hidden_size
        self.pooler = ReplicatedLinear(h, h, True, dtype)
        self.classifier = ReplicatedLinear(h, int(hf_config.num_labels), True, dtype)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.tanh(self.pooler(hidden_states))).float()

    def pool(self, hidden: list[torch.Tensor], cfg: Any) -> list[torch.Tensor]:
        return list(self.compute_logits(torch.stack([pool_tokens(h, cfg.pooling_type) for h in hidden])))

    def _rename(self, name: str) -> str | None:
        for p in self.prefixes:
            name = name.removeprefix(p)
        if name.startswith("pooler.dense."):
            return "pooler." + name.removeprefix("pooler.dense.")
        return super()._rename(name)


class NomicBertModel(GteModel):
    """nomic-embed-text: GTE's blocks without projection biases (silu gate by default); mean pooling comes
    from its sentence-transformers folder."""

    attn_bias, down_bias = False, False
    prefixes = ("nomic_bert.",)
    renames = (("emb_ln.", "embed_norm."), ("embeddings.", ""), ("encoder.layers.", "layers."),
               (".attn.Wqkv.", ".qkv."), (".attn.out_proj.", ".o."), (".norm1.", ".attn_norm."),
               (".mlp.fc11.", ".up."), (".mlp.fc12.", ".gate."), (".mlp.fc2.", ".down."), (".norm2.", ".mlp_norm."))
