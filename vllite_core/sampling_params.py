"""SamplingParams: how one request is sampled and when it stops.

Names and defaults follow vLLM so users can switch. Validation happens here, at
construction, so a bad request fails before it reaches the engine.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_GREEDY_EPS = 1e-5


class SamplingParamsError(ValueError):
    """A sampling parameter is invalid; ``param`` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # top-k logprobs per output position (sampled token always included)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    # Removed in V1; accepted only to give a clear error.
    best_of: int | None = None
    logits_processors: Any = None
    extra_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(param: str, msg: str) -> None:
            raise SamplingParamsError(param, msg)

        if self.best_of is not None and self.best_of != self.n:
            bad("best_of", "best_of is removed (as in vLLM V1): use n and rank the outputs on the client, "
                "or send several requests")
        if self.logits_processors:
            bad("logits_processors", "per-request logits processors are not supported: register a global one "
                "through the vllite_register_logits_processors plugin hook or the --logits-processors engine argument")
        if not isinstance(self.n, int) or self.n < 1:
            bad("n", f"must be an integer >= 1, got {self.n!r}")
        if self.temperature < 0.0:
            bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", f"must be 0 or -1 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if self.min_tokens < 0:
            bad("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            bad("logprobs", f"must be >= 0, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            bad("prompt_logprobs", f"must be >= 0, got {self.prompt_logprobs}")
        if any(not s for s in self.stop):  # type: ignore[union-attr]
            bad("stop", "stop strings must be non-empty")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", f"must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def max_stop_str_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)  # type: ignore[union-attr]
