"""The dense families as pooling models: Qwen3-Embedding (``Qwen3Model``, last-token embeddings) and
``Qwen3ForSequenceClassification`` (a ``score`` head on the last prompt token), through the same adapter as
the Llama family's (``vllite_core.pooling.adapters``)."""
from __future__ import annotations

from model_registry.models.qwen3 import Qwen3ForCausalLM
from vllite_core.pooling.adapters import as_pooling_model

Qwen3EmbeddingModel = as_pooling_model(Qwen3ForCausalLM, "embed")
Qwen3ForSequenceClassification = as_pooling_model(Qwen3ForCausalLM, "classify")
