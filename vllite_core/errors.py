"""The engine's typed errors, in a leaf module that imports nothing from vllite (model code, plugins and
the config all raise them without an import circle).

- ``ConfigError``: a configuration value is invalid (the message names the field); the engine does not start.
- ``InvalidRequestError`` (and ``PromptTooLongError``): a request is refused, the engine keeps serving.
- ``EngineDeadError`` / ``RequestFailedError``: what a fault inside the engine means for the open requests.
- ``EngineSleepingError``: a request reached an engine put to sleep (sleep mode).
"""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


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


class EngineDeadError(RuntimeError):
    """The engine hit an error that belongs to no request (the model's forward pass raising, say):
    every open request fails with this, naming the cause, and no request can be served any more."""


class EngineCoreDeadError(EngineDeadError):
    """One data-parallel engine core died while the others still serve: only the requests it held
    (``request_ids``, engine request ids: parallel-sampling children included) fail with this."""

    def __init__(self, message: str, request_ids: frozenset[str]) -> None:
        super().__init__(message)
        self.request_ids = request_ids


class EngineSleepingError(RuntimeError):
    """A request reached an engine put to sleep (``LLM.sleep``): its KV cache (and maybe its weights) are
    released until ``wake_up``. The request is refused; the server answers 503."""

    def __init__(self, what: str = "the request") -> None:
        super().__init__(f"{what}: the engine is sleeping (its KV cache is released); call wake_up() first")


class RequestFailedError(RuntimeError):
    """One request failed inside the engine (its logits processor input, a non-finite logits row...):
    that request ends with ``finish_reason="error"``, every other request carries on. AsyncLLM's
    stream for the request raises this; the server answers 500 with the message."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(f"request {request_id!r} failed: {message}")
        self.request_id = request_id
        self.message = message
