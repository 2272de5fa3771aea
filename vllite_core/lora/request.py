"""LoRARequest: which adapter a request runs with (vLLM's names)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """``lora_name`` is what users call it, ``lora_int_id`` (> 0) is its identity in the engine's caches
    (a new id means a new load), ``lora_path`` a directory in PEFT's format."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        from vllite_core.lora.errors import LoRAError

        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise LoRAError(self.lora_name, "lora_int_id", f"must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_path:
            raise LoRAError(self.lora_name, "lora_path", "is empty")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
