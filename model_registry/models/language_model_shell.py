"""The text half of a vision-language model: what the engine asks of the decoder, passed to ``language_model``."""
from __future__ import annotations

import torch

from vllite_core.attention.backend import AttentionMetadata
from vllite_core.core.kv_cache_spec import KVCacheSpec
from vllite_core.distributed.pipeline import IntermediateTensors


class LanguageModelShell:
    """Mixin for a model that wraps a built-in decoder as ``self.language_model`` (Llava, Qwen2-VL): the
    decoder owns the embedding, the KV cache layout, the forward and the head."""

    language_model: torch.nn.Module

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_input_ids(input_ids)

    def get_kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec]:
        return self.language_model.get_kv_cache_specs(block_size, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: list[AttentionMetadata], inputs_embeds: torch.Tensor | None = None,
                intermediate: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        """``positions`` is [T], or [3, T] for an M-RoPE decoder on a step holding prompt tokens of a request
        with images. With pipeline stages (a decoder that has them) ``intermediate`` is what the previous stage
        handed this one, and a stage before the last returns what the next continues from."""
        if intermediate is None:
            return self.language_model(input_ids, positions, kv_caches, attn_metadata, inputs_embeds=inputs_embeds)
        return self.language_model(input_ids, positions, kv_caches, attn_metadata, intermediate=intermediate)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden_states)

    def ensure_positions(self, max_model_len: int) -> None:
        self.language_model.ensure_positions(max_model_len)
