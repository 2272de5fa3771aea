"""SamplingParams: how one request is sampled and when it stops.

Names and defaults follow vLLM so users can switch. Validation happens here, at
construction, so a bad request fails before it reaches the engine.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

GREEDY_EPS = 1e-5  # temperatures below this are greedy (argmax)


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
    presence_penalty: float = 0.0  # subtracted once from tokens already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # CTRL-style: divides positive / multiplies negative logits of seen tokens
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
    bad_words: list[str] | None = None  # words (their token sequences) never generated
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # only these may be generated
    # Removed in V1; accepted only to give a clear error.
    best_of: int | None = None
    logits_processors: Any = None
    extra_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = list(self.bad_words or [])
        if self.logit_bias:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise SamplingParamsError("logit_bias", "keys must be token ids and values numbers") from None
        # Token sequences of bad_words, filled by the engine with its tokenizer.
        self.bad_words_token_ids: list[list[int]] = []
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
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not self.repetition_penalty > 0.0:
            bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            bad("allowed_token_ids", "must not be empty")
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

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids named by the request must exist in the model's vocabulary."""
        for name, ids in (("allowed_token_ids", self.allowed_token_ids or []),
                          ("logit_bias", list((self.logit_bias or {}).keys())),
                          ("stop_token_ids", self.stop_token_ids or [])):
            bad_ids = [t for t in ids if not 0 <= t < vocab_size]
            if bad_ids:
                raise SamplingParamsError(name, f"token id {bad_ids[0]} is out of range [0, {vocab_size})")

    def tokenize_bad_words(self, tokenizer: Any, vocab_size: int) -> None:
        """Each bad word bans its token sequence, with and without a leading space. Sequences with
        ids the model cannot produce (tokenizer larger than the vocabulary) can never occur: dropped."""
        seqs: list[list[int]] = []
        for word in self.bad_words or []:
            for variant in (word, " " + word.lstrip()):
                ids = list(tokenizer.encode(variant, add_special_tokens=False))
                if ids and ids not in seqs and all(0 <= t < vocab_size for t in ids):
                    seqs.append(ids)
        self.bad_words_token_ids = seqs

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def max_stop_str_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)  # type: ignore[union-attr]
