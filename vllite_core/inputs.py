"""Prompt processing for models that need more than a tokenizer (encoder-decoder, multimodal).

A model class that defines ``process_prompt(prompt, ctx) -> ProcessedPrompt`` (a
classmethod) turns a user prompt into decoder token ids plus whatever its
encoder consumes. The core stays ignorant of audio or pixels: it stores
``encoder_inputs`` on the request and hands it back to ``model.encode()``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ProcessedPrompt:
    prompt_token_ids: list[int]  # the decoder's prompt
    prompt: str | None = None
    encoder_inputs: Any = None  # opaque to the core; given back to model.encode([...])
    num_encoder_tokens: int = 0  # positions of the encoder output (cross-attention K/V length)
    cache_salt: str | None = None  # isolates this prompt's prefix-cache blocks from other salts (tenants)
    lora_adapter: Any = None  # vllite_core.lora.adapter.LoRAAdapter the request runs with (None: the base)
    # Multimodal decoders: one vllite_core.multimodal.MultiModalFeature per image (placeholder range, hash, pixels).
    mm_features: list | None = None


@dataclass
class InputContext:
    """What a model's prompt processor may use. ``processor`` loads the HF processor lazily."""

    tokenizer: Any
    hf_config: Any
    model_path: str
    _cache: dict[str, Any] = field(default_factory=dict)

    def processor(self, kind: str = "auto") -> Any:
        """transformers' processor / feature extractor for the model folder (loaded once)."""
        if kind not in self._cache:
            import transformers

            loader = {"auto": transformers.AutoProcessor,
                      "feature_extractor": transformers.AutoFeatureExtractor,
                      "image_processor": transformers.AutoImageProcessor}[kind]
            self._cache[kind] = loader.from_pretrained(self.model_path)
        return self._cache[kind]
