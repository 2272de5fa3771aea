"""How often a dead engine core may be brought back (AsyncLLM's restart budget).

At most ``max_restarts`` restarts within any ``window_s`` seconds, each after a backoff that doubles
with the restarts already made in the window (``backoff_s``, 2x, 4x, ... up to ``backoff_max_s``), so
a core that dies at once on every start cannot spin; past the budget the engine stays dead (the
server exits, as it does with restarts off: ``max_restarts`` 0).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

DEFAULT_MAX_RESTARTS = 3
DEFAULT_WINDOW_S = 600.0
DEFAULT_BACKOFF_S = 1.0
BACKOFF_MAX_S = 30.0


@dataclass
class RestartPolicy:
    max_restarts: int = DEFAULT_MAX_RESTARTS
    window_s: float = DEFAULT_WINDOW_S
    backoff_s: float = DEFAULT_BACKOFF_S
    backoff_max_s: float = BACKOFF_MAX_S
    _made: deque[float] = field(default_factory=deque)  # monotonic times of the restarts tried

    def next_delay(self, now: float | None = None) -> float | None:
        """Seconds to wait before the next restart, or None when the budget is spent."""
        now = time.monotonic() if now is None else now
        while self._made and now - self._made[0] > self.window_s:
            self._made.popleft()
        if len(self._made) >= self.max_restarts:
            return None
        return min(self.backoff_s * (2 ** len(self._made)), self.backoff_max_s)

    def record(self, now: float | None = None) -> int:
        """Count a restart (tried, whether or not it succeeded); the number made in the window."""
        self._made.append(time.monotonic() if now is None else now)
        return len(self._made)
