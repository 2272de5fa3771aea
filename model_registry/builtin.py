"""The built-in model plugin: registers vllite's own architectures through the public hook."""
from __future__ import annotations

from typing import TYPE_CHECKING

from vllite_core.plugins import hookimpl

if TYPE_CHECKING:
    from model_registry.registry import ModelRegistry

VLLITE_PLUGIN_API = (1, 0)
PLUGIN_NAME = "vllite-builtin-models"

_LLAMA = "model_registry.models.llama:LlamaForCausalLM"

# One implementation covers the Llama family (Qwen2: qkv bias; Mistral: sliding window).
BUILTIN_MODELS: dict[str, str] = {
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,
    "Qwen2ForCausalLM": _LLAMA,
    # Encoder-decoder: speech in, text out.
    "WhisperForConditionalGeneration": "model_registry.models.whisper:WhisperForConditionalGeneration",
}


@hookimpl
def vllite_register_models(registry: "ModelRegistry") -> None:
    for architecture, target in BUILTIN_MODELS.items():
        registry.register(architecture, target, plugin=PLUGIN_NAME)
