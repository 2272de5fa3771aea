"""Output objects, shaped like vLLM's so user code can switch."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None  # finish_reason "error": why this completion failed (the others are unaffected)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Per-request timings in seconds."""

    arrival_time: float
    queue_time: float | None = None  # arrival -> first scheduled
    first_scheduled_time: float | None = None  # time.monotonic() of the first schedule
    time_to_first_token: float | None = None  # arrival -> first token
    decode_time: float | None = None  # first token -> last token
    e2e_latency: float | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    structured_output_backend: str | None = None  # the backend that enforced the request's structured output


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    extra: dict = field(default_factory=dict)
    pooling_output: Any = None  # a pooling request's result (a float32 tensor); it has no completions
