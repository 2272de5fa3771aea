"""vllite: a plugin-based, hardware-neutral LLM inference engine."""
from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "EngineArgs", "RequestOutput", "CompletionOutput", "Logprob", "LoRARequest",
           "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy, so `import vllite_core` (CLI start-up, plugin listing) stays cheap.
    if name == "LLM":
        from vllite_core.entrypoints.llm import LLM
        return LLM
    if name == "SamplingParams":
        from vllite_core.sampling_params import SamplingParams
        return SamplingParams
    if name == "EngineArgs":
        from vllite_core.config import EngineArgs
        return EngineArgs
    if name == "LoRARequest":
        from vllite_core.lora.request import LoRARequest
        return LoRARequest
    if name in ("RequestOutput", "CompletionOutput", "Logprob"):
        from vllite_core import outputs
        return getattr(outputs, name)
    raise AttributeError(name)
