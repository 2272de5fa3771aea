"""PoolingParams: what a pooling request asks of the pooled output (vLLM's names and meanings)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from vllite_core.errors import InvalidRequestError

PoolingTask = Literal["embed", "classify", "score", "reward", "encode", "token_embed", "token_classify"]
POOLING_TASKS = ("embed", "classify", "score", "reward", "encode", "token_embed", "token_classify")
# Tasks answered per prompt token (vLLM's names): ALL pooling for that request, whatever the model's type.
TOKEN_TASKS = ("token_embed", "token_classify")


@dataclass
class PoolingParams:
    """``truncate_prompt_tokens``: keep only the last k prompt tokens (-1: max_model_len);
    ``dimensions``: matryoshka truncation of an embedding (then normalised); ``normalize``: L2-normalise an
    embedding (None: the model's default); ``activation``: softmax / sigmoid on class logits (None: yes for
    classify and score, no for reward); ``task``: set by ``LLM.embed`` etc. (None: the model's first); ``token_embed`` /
    ``token_classify`` ask for one embedding / logits row per prompt token."""

    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    activation: bool | None = None
    task: PoolingTask | None = None

    def __post_init__(self) -> None:

        t = self.truncate_prompt_tokens
        if t is not None and (not isinstance(t, int) or isinstance(t, bool) or (t < 1 and t != -1)):
            raise InvalidRequestError("truncate_prompt_tokens", f"must be a positive integer or -1, got {t!r}")
        d = self.dimensions
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise InvalidRequestError("dimensions", f"must be a positive integer, got {d!r}")
        if self.task is not None and self.task not in POOLING_TASKS:
            raise InvalidRequestError("task", f"must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")

    @property
    def per_token(self) -> bool:
        """Its result has one row per prompt token: no prefix-cache hits (cached tokens' states are not kept)."""
        return self.task in TOKEN_TASKS

    def with_task(self, task: PoolingTask) -> "PoolingParams":
        import dataclasses

        return dataclasses.replace(self, task=task)

    # What the async front reads off a request's params (it streams no text for pooling requests).
    n = 1
    max_stop_str_len = 0
