"""The model's recommended sampling defaults, from its ``generation_config.json`` (vLLM's ``--generation-config``).

``auto`` reads the model folder's file, a folder path reads that folder's, ``vllite`` (vLLM's
spelling ``vllm`` too) uses none of its sampling values. What counts is what the file sets
(transformers' ``to_diff_dict``), limited to the fields vLLM takes: temperature, top_p, top_k,
min_p, repetition_penalty and max_new_tokens (as max_tokens). The EOS ids the file lists are read
in every mode, as vLLM does: generation stops at any of them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from model_registry.source import ModelSource

GENERATION_CONFIG_FILE = "generation_config.json"
NO_DEFAULTS = ("vllite", "vllm")
# generation_config.json key -> SamplingParams field
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


@dataclass(frozen=True)
class GenerationDefaults:
    """What a model's generation config contributes: default sampling values and its EOS ids."""

    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams field -> value
    eos_token_ids: tuple[int, ...] = ()


def load_generation_defaults(source: ModelSource, mode: str = "auto") -> GenerationDefaults:
    """The defaults for ``source`` under ``mode`` (see the module docstring)."""
    if mode == "auto" or mode in NO_DEFAULTS:
        folder = source.path if source.kind == "hf" else None
    else:
        folder = os.path.expanduser(mode)
        if not os.path.isfile(os.path.join(folder, GENERATION_CONFIG_FILE)):
            raise ValueError(f"generation_config: no {GENERATION_CONFIG_FILE} in {folder!r}")
    values = _read(folder) if folder is not None else {}
    eos = values.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    if mode in NO_DEFAULTS:
        return GenerationDefaults({}, tuple(int(t) for t in eos_ids))
    sampling = {target: values[key] for key, target in SAMPLING_KEYS.items() if values.get(key) is not None}
    return GenerationDefaults(sampling, tuple(int(t) for t in eos_ids))


def _read(folder: str) -> dict[str, Any]:
    """The values the folder's generation config sets ({} when it has none)."""
    if not os.path.isfile(os.path.join(folder, GENERATION_CONFIG_FILE)):
        return {}
    from transformers import GenerationConfig

    return GenerationConfig.from_pretrained(folder).to_diff_dict()
