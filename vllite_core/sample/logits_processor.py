"""Global logits processors: registered once (plugin hook or engine argument), applied to
every request of every step in batched form. There are no per-request processors: a
processor that wants per-request knobs reads them from ``SamplingParams.extra_args``."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

import torch

from vllite_core.sampling_params import SamplingParams


@dataclass
class BatchInfo:
    """What a processor may look at for the rows of ``logits`` (row i is request req_ids[i])."""

    req_ids: list[str]
    params: list[SamplingParams]
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]


@runtime_checkable
class LogitsProcessor(Protocol):
    def apply(self, logits: torch.Tensor, batch: BatchInfo) -> torch.Tensor:
        """Return processed logits [num_rows, vocab] (in place or new)."""


class _CallableProcessor:
    def __init__(self, fn: Callable[[torch.Tensor, BatchInfo], torch.Tensor], name: str) -> None:
        self.fn, self.name = fn, name

    def apply(self, logits: torch.Tensor, batch: BatchInfo) -> torch.Tensor:
        return self.fn(logits, batch)


class LogitsProcessorError(ValueError):
    pass


def as_processor(obj: Any, origin: str) -> LogitsProcessor:
    """Accept a processor instance, a class (built with no arguments) or a plain function."""
    if isinstance(obj, type):
        try:
            obj = obj()
        except Exception as e:  # noqa: BLE001 - report which processor could not be built
            raise LogitsProcessorError(f"logits processor {origin}: cannot instantiate {obj.__name__}: {e}") from e
    if isinstance(obj, LogitsProcessor):
        return obj
    if callable(obj):
        return _CallableProcessor(obj, origin)
    raise LogitsProcessorError(f"logits processor {origin}: expected an object with apply(logits, batch), "
                               f"a class or a function, got {type(obj).__name__}")


def import_processor(path: str) -> LogitsProcessor:
    mod_name, _, attr = path.partition(":")
    if not attr:
        raise LogitsProcessorError(f"logits_processors: {path!r} must look like 'package.module:name'")
    try:
        obj = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as e:
        raise LogitsProcessorError(f"logits_processors: cannot import {path!r}: {e}") from e
    return as_processor(obj, path)


def load_logits_processors(paths: list[str], plugin_manager: Any) -> list[LogitsProcessor]:
    procs: list[LogitsProcessor] = []
    for result in plugin_manager.hook.vllite_register_logits_processors():
        for obj in result or []:
            procs.append(as_processor(obj, getattr(obj, "__name__", type(obj).__name__)))
    procs.extend(import_processor(p) for p in paths)
    return procs
