"""Audio in prompts for audio-language models: clips taken out of ``multi_modal_data``, chat parts decoded
(``input_audio`` base64 WAV, ``audio_url`` data: or allowed http(s) URLs), sample rates checked, content hashed.

A clip is ``(float32 mono samples, sample rate)``; the model resamples it to its feature extractor's rate
(``vllite_core.audio.resample``). WAV is decoded with the standard library (``vllite_core.audio.load_wav``):
no audio package is needed, and other containers are refused naming the part.
"""
from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from vllite_core.audio import AudioDecodeError, load_wav
from vllite_core.multimodal.config import MultiModalConfig
from vllite_core.multimodal.errors import MediaError
from vllite_core.multimodal.media import base64_payload, data_url_bytes, fetch_media

# Rates a clip may have: outside these resampling is refused (a typo such as 16 or 16_000_000 Hz, not audio).
MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 1000, 384000
AudioClip = tuple[np.ndarray, int]


def check_clip(samples: Any, sample_rate: Any, what: str, param: str) -> AudioClip:
    """``samples`` as a float32 1-D array and ``sample_rate`` as an int, or a MediaError naming ``param``."""
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, np.integer, float)) \
            or not float(sample_rate).is_integer():
        raise MediaError(param, f"{what}: the sample rate must be an integer number of Hz, got {sample_rate!r}")
    sr = int(sample_rate)
    if not MIN_SAMPLE_RATE <= sr <= MAX_SAMPLE_RATE:
        raise MediaError(param, f"{what}: sample rate {sr} Hz cannot be resampled (supported: "
                         f"{MIN_SAMPLE_RATE}..{MAX_SAMPLE_RATE} Hz)")
    if hasattr(samples, "detach"):  # a torch tensor
        samples = samples.detach().cpu().numpy()
    arr = np.asarray(samples)
    if arr.ndim != 1 or arr.size == 0:
        raise MediaError(param, f"{what} must be a non-empty 1-D array of samples (one channel), got shape "
                         f"{list(arr.shape)}")
    if not np.issubdtype(arr.dtype, np.floating):
        raise MediaError(param, f"{what} must hold float samples in [-1, 1], got dtype {arr.dtype}")
    arr = arr.astype(np.float32, copy=False)
    if not np.isfinite(arr).all():
        raise MediaError(param, f"{what} holds NaN or infinite samples")
    return arr, sr


def _is_clip(x: Any) -> bool:
    return getattr(x, "ndim", None) == 1 or (isinstance(x, tuple) and len(x) == 2 and np.isscalar(x[1]))


def prompt_audios(prompt: Any, default_rate: int) -> list[AudioClip]:
    """The prompt's clips (``{"audio": clip}`` or ``{"audio": [clips]}``; a clip is ``(samples, rate)`` as vLLM
    takes it, or a bare 1-D array at ``default_rate``); [] without audio."""
    if not isinstance(prompt, dict) or not isinstance(prompt.get("multi_modal_data"), dict):
        return []
    items = prompt["multi_modal_data"].get("audio")
    if items is None:
        return []
    items = [items] if _is_clip(items) else list(items) if isinstance(items, (list, tuple)) else [items]
    clips = []
    for i, item in enumerate(items):
        samples, sr = item if isinstance(item, tuple) and len(item) == 2 else (item, default_rate)
        clips.append(check_clip(samples, sr, f"audio {i}", "multi_modal_data"))
    return clips


def hash_audio(samples: np.ndarray, sample_rate: int) -> str:
    """Content hash of a clip (rate and samples): equal clips share encoder-cache entries and KV blocks."""
    h = hashlib.sha256(f"audio:{sample_rate}:".encode())
    h.update(np.ascontiguousarray(samples, dtype=np.float32).tobytes())
    return h.hexdigest()


def decode_wav(data: bytes, what: str, param: str) -> AudioClip:
    try:
        samples, sr = load_wav(data)
    except (AudioDecodeError, ValueError, OSError) as e:
        raise MediaError(param, f"cannot decode {what}: {e}") from None
    return check_clip(samples, sr, what, param)


def load_input_audio(part: Any, config: MultiModalConfig, param: str = "messages.content.input_audio") -> AudioClip:
    """An ``input_audio`` part's ``{"data": base64, "format": "wav"}`` (OpenAI's shape) decoded."""
    if not isinstance(part, dict) or not isinstance(part.get("data"), str) or not part["data"]:
        raise MediaError(param, "an input_audio part needs input_audio.data (base64) and input_audio.format")
    fmt = part.get("format")
    if fmt != "wav":
        raise MediaError(param + ".format", f"audio format {fmt!r} is not supported (wav)")
    data = base64_payload(part["data"], config, param + ".data", "audio")
    return decode_wav(data, "the audio", param + ".data")


def load_audio_url(url: Any, config: MultiModalConfig, param: str = "messages.content.audio_url") -> AudioClip:
    """An ``audio_url`` part's URL: ``data:audio/wav;base64,...``, or http(s) from an allowed domain."""
    if not isinstance(url, str) or not url:
        raise MediaError(param, "an audio_url part needs audio_url.url")
    data = data_url_bytes(url, config, param, "audio") if url.startswith("data:") else \
        fetch_media(url, config, param, "audio")
    return decode_wav(data, "the audio", param)
