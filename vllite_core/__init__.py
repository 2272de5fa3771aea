"""vllite: a plugin-based, hardware-neutral LLM inference engine."""
from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "BeamSearchParams", "EngineArgs", "RequestOutput",
           "CompletionOutput", "Logprob", "LoRARequest", "PoolingParams", "PoolingRequestOutput",
           "EmbeddingRequestOutput",
           "ClassificationRequestOutput", "ScoringRequestOutput", "__version__"]
_POOLING = ("PoolingParams", "PoolingRequestOutput", "EmbeddingRequestOutput", "ClassificationRequestOutput",
            "ScoringRequestOutput")


def __getattr__(name: str) -> Any:
    # Lazy, so `import vllite_core` (CLI start-up, plugin listing) stays cheap.
    if name == "LLM":
        from vllite_core.entrypoints.llm import LLM
        return LLM
    if name in ("SamplingParams", "StructuredOutputsParams", "BeamSearchParams"):
        from vllite_core import sampling_params
        return getattr(sampling_params, name)
    if name == "EngineArgs":
        from vllite_core.config import EngineArgs
        return EngineArgs
    if name == "LoRARequest":
        from vllite_core.lora.request import LoRARequest
        return LoRARequest
    if name in ("RequestOutput", "CompletionOutput", "Logprob"):
        from vllite_core import outputs
        return getattr(outputs, name)
    if name in _POOLING:
        from vllite_core import pooling
        return getattr(pooling, name)
    raise AttributeError(name)
