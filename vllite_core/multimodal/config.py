"""Engine-level multimodal settings (vLLM's names where vLLM has them)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllite_core.errors import ConfigError

MODALITIES = ("image", "video", "audio")


@dataclass
class MultiModalConfig:
    """How many images a prompt may carry, how large, where they may come from, how much encoder output is kept."""

    # Items per prompt and modality (vLLM's --limit-mm-per-prompt, e.g. {"image": 2}); unnamed modalities: 999.
    limit_mm_per_prompt: dict[str, int] = field(default_factory=dict)
    max_image_pixels: int = 4096 * 4096  # width * height above this is refused (decompression bombs included)
    # http(s) image URLs: off unless domains are allowed ("*": any); data: URLs are always accepted.
    allowed_media_domains: list[str] = field(default_factory=list)
    media_fetch_timeout: float = 5.0  # seconds per URL
    max_media_bytes: int = 20 * 1024 * 1024  # largest download or data URL payload
    # Encoder outputs kept for reuse, in embedding rows (None: max_num_batched_tokens); it also bounds the
    # encoder work of one step.
    encoder_cache_size: int | None = None

    def __post_init__(self) -> None:

        limits = self.limit_mm_per_prompt
        if isinstance(limits, str):
            limits = parse_limit_mm_per_prompt(limits)
        if not isinstance(limits, dict):
            raise ConfigError(f"limit_mm_per_prompt: must be a dict such as {{'image': 2}}, got {limits!r}")
        for k, v in limits.items():
            if k not in MODALITIES:
                raise ConfigError(f"limit_mm_per_prompt: unknown modality {k!r} (supported: {', '.join(MODALITIES)})")
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"limit_mm_per_prompt.{k}: must be an integer >= 0, got {v!r}")
        self.limit_mm_per_prompt = dict(limits)
        if self.max_image_pixels <= 0:
            raise ConfigError("max_image_pixels: must be positive")
        if not self.media_fetch_timeout > 0:
            raise ConfigError("media_fetch_timeout: must be > 0")
        if self.max_media_bytes <= 0:
            raise ConfigError("max_media_bytes: must be positive")
        if self.encoder_cache_size is not None and self.encoder_cache_size <= 0:
            raise ConfigError("encoder_cache_size: must be positive")
        if isinstance(self.allowed_media_domains, str):
            self.allowed_media_domains = [self.allowed_media_domains]
        self.allowed_media_domains = [d.strip().lower() for item in self.allowed_media_domains or []
                                      for d in str(item).replace(",", " ").split() if d.strip()]

    def limit(self, modality: str) -> int:
        return self.limit_mm_per_prompt.get(modality, 999)

    @classmethod
    def from_value(cls, value: Any) -> "MultiModalConfig":

        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            return cls(**value)
        raise ConfigError(f"multimodal_config: must be a dict, got {type(value).__name__}")


def parse_limit_mm_per_prompt(text: str) -> dict[str, int]:
    """``'{"image": 2}'`` (vLLM's JSON form) or ``image=2,video=0`` -> a dict."""
    import json


    text = text.strip()
    if text.startswith("{"):
        try:
            out = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"limit_mm_per_prompt: not valid JSON: {e}") from None
        if not isinstance(out, dict):
            raise ConfigError("limit_mm_per_prompt: must be a JSON object")
        return out
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, num = part.partition("=")
        if not sep or not num.strip().isdigit():
            raise ConfigError(f"limit_mm_per_prompt: expected MODALITY=N, got {part!r}")
        out[key.strip()] = int(num)
    return out
