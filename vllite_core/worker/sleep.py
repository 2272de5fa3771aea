"""Sleep mode on one worker (vLLM's ``enable_sleep_mode``): what ``sleep(level)`` releases and
``wake_up(tags)`` restores, and giving the freed memory back to the operating system.

- level 1 releases the KV cache (its contents are lost: the engine forgets every cached prefix). The
  weights stay in host memory: a CPU worker keeps them where they are; a worker on a device copies them
  to host memory and lets the device's copy go (``offload_weights``), as vLLM does.
- level 2 releases the weights too; waking them reloads the checkpoint (a trainer then pushes its own
  weights with ``load_weights``).

Freed host memory goes back to the OS: the garbage collector drops what cycles held, then glibc's
``malloc_trim`` returns the heap pages it kept (engine/heap_trim.py), so the process's RSS drops.
"""
from __future__ import annotations

import gc
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from vllite_core.engine.heap_trim import trim_heap
from vllite_core.platforms.interface import Platform

SLEEP_LEVELS = (1, 2)
# vLLM's sleep(mode=...): what becomes of the requests in flight. "abort" (vLLM's default) ends them with
# finish_reason "abort"; "wait" refuses new requests and sleeps once those in flight are done; "keep"
# (freeze them and go on after wake_up) is refused: their KV cache is what level 1 and 2 release.
SLEEP_MODES = ("abort", "wait", "keep")
WAKE_TAGS = ("weights", "kv_cache")  # vLLM's wake_up(tags=...): what to restore (None: both)


@dataclass
class SleepState:
    """What this worker released; level 0 when awake."""

    level: int = 0
    weights: bool = False  # the weights are released (level 2) or in host memory (level 1 on a device)
    kv_cache: bool = False  # the KV cache is released

    @property
    def sleeping(self) -> bool:
        return self.weights or self.kv_cache


@dataclass
class SleepReport:
    """Bytes one worker released by a ``sleep`` (rank order in the engine's list)."""

    kv_cache_bytes: int
    weight_bytes: int


def check_level(level: int) -> int:
    if level not in SLEEP_LEVELS:
        raise ValueError(f"level: must be 1 (release the KV cache) or 2 (and the weights), got {level!r}")
    return level


def check_mode(mode: str) -> str:
    if mode not in SLEEP_MODES:
        raise ValueError(f"mode: must be one of {', '.join(SLEEP_MODES)}, got {mode!r}")
    if mode == "keep":
        raise ValueError("mode: 'keep' (requests frozen across the sleep) is not served here: sleep releases the KV "
                         "cache they hold; use 'wait' (let them finish) or 'abort'")
    return mode


def check_tags(tags: list[str] | None) -> list[str]:
    """The tags to wake, weights first (a KV cache is of no use without a model to read it)."""
    if tags is None:
        return list(WAKE_TAGS)
    unknown = [t for t in tags if t not in WAKE_TAGS]
    if unknown:
        raise ValueError(f"tags: unknown tag(s) {unknown}; known: {list(WAKE_TAGS)}")
    return [t for t in WAKE_TAGS if t in tags]


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of distinct storages (a tied head and a cache tensor shared by two layers count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t.numel():
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def model_tensors(model: torch.nn.Module) -> Iterator[torch.Tensor]:
    yield from model.parameters()
    yield from model.buffers()


def offload_weights(model: torch.nn.Module) -> None:
    """Every parameter and buffer copied to host memory (level 1 on a device); its device copy freed."""
    for t in model_tensors(model):
        t.data = t.data.to("cpu")


def restore_weights(model: torch.nn.Module, device: torch.device) -> None:
    for t in model_tensors(model):
        t.data = t.data.to(device)


def mark_changed(model: torch.nn.Module) -> None:
    """Bump every parameter's version counter after new values were copied in through ``.data`` (which
    bumps nothing): a platform's packed copy of a weight, keyed by that version, is then remade."""
    from torch.autograd.graph import increment_version

    for p in model.parameters():
        if not p.is_inference():
            increment_version(p)


def give_back_memory(platform: Platform) -> None:
    """After tensors were dropped: collect cycles, let the platform return its cached device memory
    (``Platform.empty_cache``), and return freed heap pages to the OS."""
    gc.collect()
    platform.empty_cache()
    trim_heap()
