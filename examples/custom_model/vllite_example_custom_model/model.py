"""MyLlamaForCausalLM: a Llama-style decoder composed from vllite's public layers (``model_registry.layers``).

A model class for vllite's engine takes ``(hf_config, attn_backend, dtype)`` and provides
(``vllite_core.model_interfaces.CausalModel``) ``get_kv_cache_specs(block_size, dtype)`` (one cache spec
per attention layer), ``forward(input_ids, positions, kv_caches, attn_metadata) -> hidden`` (one cache and
one metadata per layer), ``compute_logits(hidden)``, ``load_weights(weights) -> set of loaded parameter
names`` and ``vocab_size``. The layers bring the rest: uninitialised weights that the checkpoint fills through
their ``weight_loader`` (fused q/k/v and gate/up included), the platform's kernels, the paged attention layer
that declares its cache, and the typed record a platform's fused decoder path reads. Module names follow the
Hugging Face checkpoint's, so its tensors load as they are.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from model_registry.layers import (
    LAYERS_API,
    Attention,
    DecoderLayerRecord,
    GatedMLP,
    NormRecord,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    apply_rotary,
    load_parameter,
)
from vllite_core.attention.backend import AttentionBackend, AttentionMetadata
from vllite_core.core.kv_cache_spec import KVCacheSpec
from vllite_core.model_ops import current_model_ops

WRITTEN_FOR_LAYERS_API = (1, 0)  # a minor bump only adds names; a major one may change what this uses
if LAYERS_API[0] != WRITTEN_FOR_LAYERS_API[0] or LAYERS_API < WRITTEN_FOR_LAYERS_API:
    raise ImportError(f"vllite-example-custom-model needs model_registry.layers {WRITTEN_FOR_LAYERS_API}, "
                      f"this vllite has {LAYERS_API}")

Rope = tuple[torch.Tensor, torch.Tensor]  # this step's cos and sin rows, one per token


class MyAttention(nn.Module):
    def __init__(self, c: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        heads = c.num_attention_heads
        self.head_size = getattr(c, "head_dim", None) or c.hidden_size // heads
        self.qkv_proj = QKVParallelLinear(c.hidden_size, self.head_size, heads, c.num_key_value_heads, False, dtype)
        local = self.qkv_proj.heads  # this rank's query and KV heads
        self.split = [local.num_heads, local.num_kv_heads, local.num_kv_heads]
        self.o_proj = RowParallelLinear(heads * self.head_size, c.hidden_size, False, dtype)
        self.attn = Attention(local.num_heads, local.num_kv_heads, self.head_size, attn_backend)
        self.ops = current_model_ops()

    def forward(self, rope: Rope, x: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).view(t, -1, self.head_size).split_with_sizes(self.split, 1)
        q, k = apply_rotary(self.ops, q, k, *rope)
        return self.o_proj(self.attn(q, k, v, kv_cache, md).reshape(t, -1))


class MyDecoderLayer(nn.Module):
    """Pre-norm: ``h = x + attn(norm(x))``, ``out = h + mlp(norm(h))``, each residual add fused into the next
    norm (``RMSNorm.add_forward``), so the layer passes (output, residual) on."""

    def __init__(self, c: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.self_attn = MyAttention(c, attn_backend, dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, dtype)
        self.native: Any = None  # the platform's fused call for this record, or False; made on first use

    def fast_path_record(self) -> DecoderLayerRecord:
        """This layer as a platform's fused path knows it (the CPU platform runs it in one C++ call)."""
        n1, n2, attn = self.input_layernorm, self.post_attention_layernorm, self.self_attn
        return DecoderLayerRecord(
            input_norm=NormRecord("rms", n1.weight, n1.eps), post_attention_norm=NormRecord("rms", n2.weight, n2.eps),
            qkv_proj=attn.qkv_proj, o_proj=attn.o_proj, gate_up_proj=self.mlp.gate_up_proj,
            down_proj=self.mlp.down_proj, attention=attn.attn, activation="silu", rope="neox", ops=attn.ops)

    def native_layer(self) -> Any:
        """The platform's fused call, asked for once after loading (the weights are the final ones): the loader
        asks every such layer and logs how many take it (``model_registry.layers.fast_path.report_fast_paths``)."""
        if self.native is None:
            self.native = self.self_attn.ops.decoder_layer(self.fast_path_record()) or False
        return self.native or None

    def forward(self, rope: Rope, x: torch.Tensor, residual: torch.Tensor | None, kv_cache: torch.Tensor,
                md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        native = self.native_layer()
        out = native(rope, x, residual, kv_cache, md) if native else None
        if out is not None:
            return out
        if residual is None:  # the first layer: x is the embedding
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(rope, h, kv_cache, md)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class MyLlamaModel(nn.Module):
    def __init__(self, c: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(c.vocab_size, c.hidden_size, dtype)
        self.rotary_emb = RotaryEmbedding(c, getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
        self.layers = nn.ModuleList(MyDecoderLayer(c, attn_backend, dtype) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: list[AttentionMetadata]) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        rope = self.rotary_emb.lookup(positions, x.dtype)  # once per step, shared by every layer
        for layer, kv_cache, md in zip(self.layers, kv_caches, attn_metadata, strict=True):
            x, residual = layer(rope, x, residual, kv_cache, md)
        return self.norm.add_forward(x, residual)[0]


# Checkpoint tensor -> (the fused parameter holding it, its shard there).
_FUSED = {".q_proj.": (".qkv_proj.", "q"), ".k_proj.": (".qkv_proj.", "k"), ".v_proj.": (".qkv_proj.", "v"),
          ".gate_proj.": (".gate_up_proj.", "gate"), ".up_proj.": (".gate_up_proj.", "up")}
_SHARDS = {"qkv_proj": {"q", "k", "v"}, "gate_up_proj": {"gate", "up"}}


class MyLlamaForCausalLM(nn.Module):
    """A Llama-architecture checkpoint served under the name ``MyLlamaForCausalLM`` (``model_type: llama``)."""

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        c = hf_config
        self.vocab_size: int = c.vocab_size
        self.tied = bool(getattr(c, "tie_word_embeddings", False))
        self.model = MyLlamaModel(c, attn_backend, dtype)
        self.lm_head = ParallelLMHead(c.vocab_size, c.hidden_size, dtype,
                                      tied=self.model.embed_tokens if self.tied else None)

    def get_kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec]:
        return [layer.self_attn.attn.kv_cache_spec(block_size, dtype) for layer in self.model.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: list[AttentionMetadata]) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Each HF tensor into its parameter (this rank's part of it, by the parameter's ``weight_loader``);
        a fused parameter counts as loaded once every shard has arrived."""
        params = dict(self.named_parameters(remove_duplicate=False))
        seen: dict[str, set[str | None]] = {}
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq") or (self.tied and name == "lm_head.weight"):
                continue
            target, shard = name, None
            for part, (fused, shard_name) in _FUSED.items():
                if part in name:
                    target, shard = name.replace(part, fused), shard_name
            if target not in params:
                raise ValueError(f"checkpoint has a weight this model does not know: {name}")
            load_parameter(params[target], tensor, shard, name)
            seen.setdefault(target, set()).add(shard)
        loaded = {n for n, shards in seen.items() if shards == _SHARDS.get(n.split(".")[-2], {None})}
        if self.tied and "model.embed_tokens.weight" in loaded:
            loaded.add("lm_head.weight")
        return loaded
