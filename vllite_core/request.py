"""Request: the engine's record of one sequence, shared by scheduler and KV cache manager."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from vllite_core.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH_CAPPED: "length",
                RequestStatus.FINISHED_ABORTED: "abort"}.get(self)


@dataclass
class RequestTimes:
    """Timestamps (time.monotonic) for per-request metrics."""

    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    priority: int = 0
    arrival_time: float = field(default_factory=time.time)
    block_extra_keys: tuple = ()
    max_tokens: int = 16  # resolved from sampling_params and max_model_len by the engine
    # Encoder-decoder models: what the model's encoder consumes (opaque to the core) and its length.
    encoder_inputs: Any = None
    num_encoder_tokens: int = 0
    # Mixed into the first block's hash: requests with different salts never share cached blocks.
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        self.status = RequestStatus.WAITING
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit on first schedule
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.times = RequestTimes()
        # Prompt logprobs are never served from the cache: recompute the whole prompt.
        self.skip_prefix_cache = self.sampling_params.prompt_logprobs is not None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def sort_key(self) -> tuple[int, float]:
        """Order under the priority policy: lower priority value first, then earlier arrival."""
        return (self.priority, self.arrival_time)
