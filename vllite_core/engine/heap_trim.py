"""Give freed heap memory back to the operating system (glibc's ``malloc_trim``).

A server allocates and frees many short-lived buffers (tokenizer work, per-step numpy and torch
temporaries, HTTP bodies). glibc keeps freed memory in its arenas instead of returning it, so the
resident size of `vllite serve` grew by about 200 MB over a 1,000-request soak although nothing
leaked: trimming every 30 s kept it flat (docs/serving.md, "Reliability figures"). The engine loop
trims when it goes idle and at most every ``interval_s`` while busy; a trim takes milliseconds
(``vllite:engine_loop_seconds_total{phase="trim"}`` counts them). Where the C library has no
``malloc_trim`` (musl, macOS, Windows) this does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import time
from typing import Callable

# Seconds between trims while the engine is busy; 0 turns trimming off.
INTERVAL_ENV = "VLLITE_MALLOC_TRIM_INTERVAL_S"
DEFAULT_INTERVAL_S = 30.0


def _load_malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return getattr(libc, "malloc_trim", None)
    except OSError:
        return None


def trim_heap() -> bool:
    """Trim once now (sleep mode, after the KV cache or the weights were freed); False where the C
    library has no ``malloc_trim``."""
    trim = _load_malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


class HeapTrimmer:
    def __init__(self, interval_s: float | None = None) -> None:
        if interval_s is None:
            interval_s = float(os.environ.get(INTERVAL_ENV, DEFAULT_INTERVAL_S))
        self.interval_s = interval_s
        self._trim = _load_malloc_trim() if interval_s > 0 else None
        self._last = time.monotonic()
        self._dirty = False  # the engine ran since the last trim
        self.count = 0

    def note_work(self) -> None:
        self._dirty = True

    def maybe_trim(self, idle: bool) -> float:
        """Trim if the engine ran since the last trim and is now idle or ``interval_s`` has passed;
        the seconds spent."""
        if self._trim is None or not self._dirty:
            return 0.0
        now = time.monotonic()
        if not idle and now - self._last < self.interval_s:
            return 0.0
        self._trim(0)
        self._dirty = False
        self.count += 1
        self._last = time.monotonic()
        return self._last - now
