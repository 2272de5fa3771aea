"""The Llama family (Llama, Qwen2, Mistral) as pooling models: last-token embeddings and sequence
classification (``*ForSequenceClassification`` checkpoints: a ``score`` head on the final normed state
of the last prompt token, as transformers computes it)."""
from __future__ import annotations

from model_registry.models.llama import LlamaForCausalLM
from vllite_core.pooling.adapters import as_pooling_model

LlamaEmbeddingModel = as_pooling_model(LlamaForCausalLM, "embed")
LlamaForSequenceClassification = as_pooling_model(LlamaForCausalLM, "classify")
