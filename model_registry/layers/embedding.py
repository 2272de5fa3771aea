"""A replicated lookup table: learned positions, token types, the token table of a model that keeps its whole
vocabulary on every rank (the vocabulary-parallel one is ``vocab.VocabParallelEmbedding``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model_registry.layers.params import empty_param


class Embedding(nn.Module):
    """Rows of ``weight`` [num_embeddings, embedding_dim] by index (``F.embedding``, as ``nn.Embedding``
    computes it), without its init."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.weight = empty_param(num_embeddings, embedding_dim, dtype=dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
