"""What GET /health checks beyond "the engine loop is alive": that the engine core and the prep
thread are still making progress, so a supervisor (or a load balancer) sees a wedged server.

- an engine core process that is stopped (SIGSTOP, a debugger) or gone: 503 at once;
- requests in flight and no engine step for ``stall_s``: 503 (a core stuck in a step);
- a no-op queued on the prep thread not run within ``stall_s``: 503 (preparation wedged).
Each answers 200 again as soon as progress resumes.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

DEFAULT_STALL_S = 30.0


def _noop() -> None:
    return None


class HealthMonitor:
    def __init__(self, engine: Any, stall_s: float = DEFAULT_STALL_S) -> None:
        self.engine = engine
        self.stall_s = stall_s
        self._snapshot: object = None
        self._snapshot_seen = time.monotonic()
        self._probe: asyncio.Future | None = None
        self._probe_sent = 0.0

    def _core_problem(self) -> str | None:
        import psutil

        # read each time: a restarted engine core has a new pid
        # a core on another node (data parallel, headless) is watched through its link (core_processes.py)
        for pid in [c["pid"] for c in self.engine.layout()["engine_cores"]
                    if not c.get("in_process") and not c.get("remote")]:
            try:
                status = psutil.Process(pid).status()
            except psutil.NoSuchProcess:
                return f"engine core pid {pid} is gone"
            if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP, psutil.STATUS_ZOMBIE,
                          psutil.STATUS_DEAD):
                return f"engine core pid {pid} is {status}"
        return None

    def _step_problem(self, now: float) -> str | None:
        snap = self.engine.snapshot  # replaced after every engine step
        if snap is not self._snapshot or not self.engine.num_in_flight:
            self._snapshot, self._snapshot_seen = snap, now
            return None
        if now - self._snapshot_seen > self.stall_s:
            return f"no engine step for {now - self._snapshot_seen:.0f} s with requests in flight"
        return None

    def _prep_problem(self, now: float) -> str | None:
        if self._probe is not None and self._probe.done():
            self._probe = None
        if self._probe is None:
            self._probe = asyncio.ensure_future(self.engine.run_prep(_noop))
            self._probe_sent = now
            return None
        if now - self._probe_sent > self.stall_s:
            return f"request preparation has made no progress for {now - self._probe_sent:.0f} s"
        return None

    def problem(self) -> str | None:
        """Why the server cannot serve right now, or None."""
        now = time.monotonic()
        return self._core_problem() or self._step_problem(now) or self._prep_problem(now)
