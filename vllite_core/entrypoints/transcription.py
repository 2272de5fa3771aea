"""Speech-to-text on top of generate(): what ``LLM.transcribe`` and POST /v1/audio/transcriptions share.

A model transcribes when its class says ``supports_transcription = True`` and
provides ``max_audio_seconds(ctx)`` (audio per request) and
``language_detection_prompt(ctx)``; its ``process_prompt`` takes
``{"multi_modal_data": {"audio": (samples, rate)}, "language", "task",
"timestamps", "prompt"}``. Audio longer than one window is split into
consecutive windows, one request each, and their texts are joined.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllite_core.audio import load_wav, split_windows
from vllite_core.outputs import RequestOutput
from vllite_core.sampling_params import SamplingParams

DEFAULT_SAMPLE_RATE = 16000
AUTO_LANGUAGE = ("auto", None)


@dataclass
class Transcription:
    text: str
    language: str | None  # the language asked for or detected (None: an English-only model, not asked)
    duration: float  # seconds of audio
    windows: list[RequestOutput] = field(default_factory=list)  # one request per window of audio, in order


def check_transcription_model(engine: Any) -> None:
    """ValueError unless the engine's model declares SupportsTranscription."""
    if not engine.config.model_config.capabilities.supports_transcription:
        raise ValueError(f"{engine.model_cls.__name__} does not transcribe audio; "
                         f"load a speech model such as Whisper")


def as_audio(audio: Any) -> tuple[np.ndarray, int]:
    """A WAV path or bytes, ``(samples, sample_rate)``, or a 1-D float array (taken as 16 kHz)."""
    if isinstance(audio, (str, os.PathLike, bytes, bytearray)):
        return load_wav(audio)
    if isinstance(audio, tuple) and len(audio) == 2:
        samples, sr = audio
        return np.asarray(samples, dtype=np.float32), int(sr)
    return np.asarray(audio, dtype=np.float32), DEFAULT_SAMPLE_RATE


def window_prompts(samples: np.ndarray, sr: int, window_s: float, language: str | None, task: str,
                   prompt: str | None, timestamps: bool) -> list[dict[str, Any]]:
    out = []
    for chunk in split_windows(samples, sr, window_s):
        p: dict[str, Any] = {"multi_modal_data": {"audio": (chunk, sr)}, "task": task, "timestamps": timestamps,
                             "language": language}
        if prompt:
            p["prompt"] = prompt
        out.append(p)
    return out


def detection_request(model_cls: Any, ctx: Any, samples: np.ndarray, sr: int, window_s: float
                      ) -> tuple[dict[str, Any], SamplingParams, dict[int, str]] | None:
    """A one-token request whose greedy choice among the language tokens is the spoken language
    (None for models without language tokens)."""
    ids, langs = model_cls.language_detection_prompt(ctx)
    if not langs:
        return None
    first = samples[: max(1, int(window_s * sr))]
    params = SamplingParams(temperature=0.0, max_tokens=1, allowed_token_ids=sorted(langs))
    return {"prompt_token_ids": ids, "multi_modal_data": {"audio": (first, sr)}}, params, langs


def default_params(params: SamplingParams | None) -> SamplingParams:
    return params if params is not None else SamplingParams(temperature=0.0, max_tokens=None)


def join_text(outputs: list[RequestOutput]) -> str:
    return " ".join(t for t in (o.outputs[0].text.strip() for o in outputs) if t)
