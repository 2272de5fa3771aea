"""The engine loop's heap trimmer (vllite_core/engine/heap_trim.py) returns freed memory to the OS:
memory freed but pinned below a live allocation stays resident until malloc_trim, which the
trimmer calls when the engine goes idle (or every interval while busy)."""
from __future__ import annotations

import time

import numpy as np
import pytest

from vllite_core.engine.heap_trim import HeapTrimmer, _load_malloc_trim

pytestmark = pytest.mark.skipif(_load_malloc_trim() is None, reason="the C library has no malloc_trim")


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_trim_gives_freed_heap_back():
    trimmer = HeapTrimmer(interval_s=3600)
    assert trimmer.maybe_trim(idle=True) == 0.0 and trimmer.count == 0  # nothing ran since: no trim
    # 40,000 blocks of 4 KiB (below glibc's mmap threshold, so they come from the heap), then one
    # live block on top that stops free() from shrinking the heap by itself.
    blocks = [np.ones(512) for _ in range(40_000)]
    pin = np.ones(512)
    del blocks
    before = rss_mb()
    trimmer.note_work()
    assert trimmer.maybe_trim(idle=False) == 0.0 and trimmer.count == 0  # busy, interval not reached
    trimmer.maybe_trim(idle=True)
    after = rss_mb()
    assert trimmer.count == 1
    assert before - after > 100, (before, after)  # about 160 MB were free but resident
    del pin


def test_interval_while_busy_and_off_switch(monkeypatch):
    busy = HeapTrimmer(interval_s=0.001)
    busy.note_work()
    time.sleep(0.01)
    busy.maybe_trim(idle=False)
    assert busy.count == 1
    monkeypatch.setenv("VLLITE_MALLOC_TRIM_INTERVAL_S", "0")
    off = HeapTrimmer()
    off.note_work()
    assert off.maybe_trim(idle=True) == 0.0 and off.count == 0
