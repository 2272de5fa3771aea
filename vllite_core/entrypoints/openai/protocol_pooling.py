"""The pooling endpoints' request bodies (vLLM's shapes; served by serving_pooling.py), in a module that
imports pydantic only, so the large-body parse helper (body_parser.py) validates them without torch."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from vllite_core.entrypoints.openai.protocol import Int, _Strict

TokenIds = list[Int]
Input = str | list[str] | TokenIds | list[TokenIds]


class PoolingRequestBase(_Strict):
    model: str | None = None
    truncate_prompt_tokens: Int | None = None
    user: str | None = None


class EmbeddingRequest(PoolingRequestBase):
    input: Input
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = None
    normalize: bool | None = None


class PoolingRequest(PoolingRequestBase):
    input: Input
    task: str | None = None  # vLLM's pooling task; None: "encode" (the model's own pooling)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = None
    normalize: bool | None = None
    activation: bool | None = None


class ClassificationRequest(PoolingRequestBase):
    input: str | list[str] | TokenIds | list[TokenIds]
    activation: bool | None = None


class ScoreRequest(PoolingRequestBase):
    text_1: str | list[str]
    text_2: str | list[str]
    activation: bool | None = None


class RerankRequest(PoolingRequestBase):
    query: str
    documents: list[str]
    top_n: Int | None = Field(default=None)
    return_documents: bool = True
    activation: bool | None = None
