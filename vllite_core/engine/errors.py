"""Typed errors for bad requests: the request is refused, the engine keeps serving."""
from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request cannot be served as given; ``param`` names the offending field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class PromptTooLongError(InvalidRequestError):
    def __init__(self, num_tokens: int, max_model_len: int) -> None:
        super().__init__("prompt", f"the prompt has {num_tokens} tokens, more than max_model_len={max_model_len} "
                         "leaves room for (at least one output token is needed)")
        self.num_tokens = num_tokens
        self.max_model_len = max_model_len
