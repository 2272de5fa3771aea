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
    error: str | None = None  # why the request failed in the engine (then ``outputs`` is None)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class EmbeddingRequestOutput(PoolingRequestOutput):
    outputs: EmbeddingOutput

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        return cls(out.request_id, out.outputs and EmbeddingOutput(out.outputs.data.tolist()), out.prompt_token_ids,
                   out.finished, out.prompt, out.error)


class ClassificationRequestOutput(PoolingRequestOutput):
    outputs: ClassificationOutput

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> "ClassificationRequestOutput":
        return cls(out.request_id, out.outputs and ClassificationOutput(out.outputs.data.tolist()),
                   out.prompt_token_ids, out.finished, out.prompt, out.error)


class ScoringRequestOutput(PoolingRequestOutput):
    outputs: ScoringOutput

    @classmethod
    def from_score(cls, request_id: str, score: float | None, prompt_token_ids: list[int],
                   error: str | None = None) -> "ScoringRequestOutput":
        """``error``: a pair whose pooling failed in the engine (no score)."""
        return cls(request_id, None if error else ScoringOutput(float(score)), prompt_token_ids, True, None, error)


def pooling_error(out: Any) -> str | None:
    """Why the engine failed this pooling request (it finished with no pooled result), or None."""
    if out.pooling_output is not None:
        return None
    return next((c.error for c in out.outputs if c.error), None) or "the request failed in the engine"


def as_pooling_output(out: Any) -> PoolingRequestOutput:
    """The engine's RequestOutput of a finished pooling request, as a PoolingRequestOutput; one that
    failed in the engine has ``outputs=None`` and its ``error`` (the rest of the batch are unaffected)."""
    err = pooling_error(out)
    return PoolingRequestOutput(out.request_id, None if err else PoolingOutput(out.pooling_output),
                                list(out.prompt_token_ids), out.finished, out.prompt, err)
