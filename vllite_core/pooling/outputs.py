"""Pooling outputs, shaped like vLLM's (``EmbeddingRequestOutput.outputs.embedding`` and so on)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class PoolingOutput:
    data: torch.Tensor  # the pooled result, float32 on the host


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class EmbeddingRequestOutput(PoolingRequestOutput):
    outputs: EmbeddingOutput

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        return cls(out.request_id, EmbeddingOutput(out.outputs.data.tolist()), out.prompt_token_ids, out.finished,
                   out.prompt)


class ClassificationRequestOutput(PoolingRequestOutput):
    outputs: ClassificationOutput

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> "ClassificationRequestOutput":
        return cls(out.request_id, ClassificationOutput(out.outputs.data.tolist()), out.prompt_token_ids,
                   out.finished, out.prompt)


class ScoringRequestOutput(PoolingRequestOutput):
    outputs: ScoringOutput

    @classmethod
    def from_score(cls, request_id: str, score: float, prompt_token_ids: list[int]) -> "ScoringRequestOutput":
        return cls(request_id, ScoringOutput(float(score)), prompt_token_ids, True, None)


def as_pooling_output(out: Any) -> PoolingRequestOutput:
    """The engine's RequestOutput of a finished pooling request, as a PoolingRequestOutput."""
    return PoolingRequestOutput(out.request_id, PoolingOutput(out.pooling_output), list(out.prompt_token_ids),
                                out.finished, out.prompt)
