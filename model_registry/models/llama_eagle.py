"""An EAGLE-1 draft head for Llama targets (checkpoints in EAGLE's format).

The head predicts the target's next feature from the current one: ``fc`` maps concat(embedding of the next
token, target hidden state) [2H] to H, then one Llama decoder layer whose input norm is absent (EAGLE-1
layer 0), no final norm; the target's LM head turns the result into logits. The embedding is the target's
unless the checkpoint carries its own ``embed_tokens``.

Checkpoint names (EAGLE's): ``fc.weight`` (optional ``fc.bias``), ``layers.0.self_attn.{q,k,v,o}_proj``,
``layers.0.mlp.{gate,up,down}_proj``, ``layers.0.post_attention_layernorm`` (optional
``layers.0.input_layernorm``), optional ``embed_tokens.weight``; a leading ``model.`` is accepted.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from model_registry.layers import ReplicatedLinear, RotaryEmbedding, empty_param
from model_registry.layers.params import STACKED_PROJECTIONS, load_by_name
from model_registry.models.llama import LlamaDecoderLayer
from vllite_core.attention.backend import AttentionBackend, AttentionMetadata
from vllite_core.core.kv_cache_spec import KVCacheSpec


class _NoNorm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class EagleLlamaHead(nn.Module):
    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype, names: set[str]) -> None:
        """``names``: the checkpoint's tensor names (``model.`` stripped), which decide the optional parts."""
        super().__init__()
        h = hf_config.hidden_size
        self.fc = ReplicatedLinear(2 * h, h, "fc.bias" in names, dtype)
        self.layers = nn.ModuleList([LlamaDecoderLayer(hf_config, attn_backend, dtype, None)])
        if "layers.0.input_layernorm.weight" not in names:
            self.layers[0].input_layernorm = _NoNorm()
        own_embedding = "embed_tokens.weight" in names
        self.embed_tokens = empty_param(hf_config.vocab_size, h, dtype=dtype) if own_embedding else None
        self.rotary_emb = RotaryEmbedding(hf_config, self.layers[0].self_attn.head_size)

    def get_kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec]:
        return [self.layers[0].self_attn.attn.kv_cache_spec(block_size, dtype)]

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: list[AttentionMetadata]) -> torch.Tensor:
        """The predicted features [T, H] (before the LM head) of rows (next token's embedding, feature)."""
        x = self.fc(torch.cat([embeds, hidden.to(embeds.dtype)], dim=-1))
        rope = self.rotary_emb.lookup(positions, x.dtype)
        out, residual = self.layers[0](rope, x, None, kv_caches[0], attn_metadata[0])
        return out + residual

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Every parameter must arrive (a fused one with all its shards); unknown names are errors."""

        def rename(name: str) -> str | None:
            if name.endswith("rotary_emb.inv_freq"):
                return None
            return "embed_tokens" if name == "embed_tokens.weight" else name

        loaded = load_by_name(self, weights.items(), rename, STACKED_PROJECTIONS)
        missing = sorted(set(dict(self.named_parameters())) - loaded)
        if missing:
            raise ValueError(f"EAGLE head checkpoint: missing {missing[:8]}")


def load_eagle_head(folder: str, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype,
                    device: torch.device) -> EagleLlamaHead:
    from model_registry.loader import iter_hf_weights

    weights = {n[len("model."):] if n.startswith("model.") else n: t for n, t in iter_hf_weights(folder)}
    with torch.device(device):
        head = EagleLlamaHead(hf_config, attn_backend, dtype, set(weights))
    head.load_weights(weights)
    return head.eval()
