"""The typed error for an adapter that cannot be served: names the adapter and the field."""
from __future__ import annotations

from vllite_core.errors import InvalidRequestError


class LoRAError(InvalidRequestError):
    """An adapter is refused (bad config field, shape, file, rank); the engine keeps serving others.
    ``param`` is the offending field (``r``, ``target_modules``, ``adapter_model.safetensors``, ...)."""

    def __init__(self, lora_name: str, field: str, message: str) -> None:
        super().__init__(field, f"LoRA adapter {lora_name!r}: {message}")
        self.lora_name = lora_name
