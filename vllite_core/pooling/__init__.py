"""Pooling models: embeddings, classification, scores and rewards instead of generated tokens.

A pooling request is prefill-only: it is scheduled like any prompt (chunked and prefix-cached when a
causal model pools its last token; chunked, with no prefix hits for itself, when it pools every token),
and finishes after its last prompt chunk with the model's pooled output (``IsPooling.pool``), post-processed
per request (``PoolingParams``)."""
from vllite_core.pooling.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from vllite_core.pooling.params import PoolingParams

__all__ = ["ClassificationOutput", "ClassificationRequestOutput", "EmbeddingOutput", "EmbeddingRequestOutput",
           "PoolingOutput", "PoolingParams", "PoolingRequestOutput", "ScoringOutput", "ScoringRequestOutput"]
