"""How often a dead engine core may be brought back (AsyncLLM's restart budget).

At most ``max_restarts`` restarts within any ``window_s`` seconds, each after a backoff that doubles
with the restarts already made in the window (``backoff_s``, 2x, 4x, ... up to ``backoff_max_s``), so
a core that dies at once on every start cannot spin; past the budget the engine stays dead (the
server exits, as it does with restarts off: ``max_restarts`` 0). ``CoreRestarter`` carries a restart
out on AsyncLLM's engine-loop thread without stopping it.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllite_core.engine.llm_engine import LLMEngine

logger = logging.getLogger("vllite.async_llm")

DEFAULT_MAX_RESTARTS = 3
DEFAULT_WINDOW_S = 600.0
DEFAULT_BACKOFF_S = 1.0
BACKOFF_MAX_S = 30.0
POLL_S = 0.1  # how often an idle engine loop looks whether a starting core serves yet


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


class CoreRestarter:
    """On the engine-loop thread: brings dead engine cores back in steps that never wait for a model
    load, so the loop keeps stepping the live data-parallel cores while a dead one loads.

    ``core_died`` when a step raised a core's death (after the caller failed its requests), then
    ``advance`` on every turn of the loop while ``cause`` is set: after the policy's backoff it starts
    the dead core(s), then polls them until they serve; a failed start-up is tried again after the
    next backoff, and past the budget ``gave_up`` holds the cause (the engine is dead)."""

    def __init__(self, engine: LLMEngine, policy: RestartPolicy | None) -> None:
        self.engine = engine
        self.policy = policy
        self.cause: BaseException | None = None  # why, while a restart is under way
        self.whole = False  # every core died: none can take a request until the restart ends
        self.gave_up: BaseException | None = None  # the budget is spent: the engine is dead
        self.num_restarts = 0  # restarts that brought the core(s) back
        self._start_at: float | None = None  # monotonic time to start the dead core(s)
        self._loading = False  # started, not serving yet
        self._made = 0  # restarts tried in the policy's window

    def core_died(self, cause: BaseException, lost: frozenset[str] | None) -> bool:
        """A core died (``lost``: the data-parallel core's request ids; None: every core's): forget its
        requests and plan its start; False when it may not start again (the engine is dead)."""
        delay = self.policy.next_delay() if self.policy is not None else None
        if delay is None:
            if self.policy is not None:
                self._log_budget_spent()
            return False
        if lost is None:
            logger.error("%s; the engine core restarts in %g s", cause, delay)
        else:
            logger.error("%s; it restarts in %g s (%d requests fail; the other cores' go on)", cause, delay,
                         len(lost))
        self.engine.release_core(lost)
        self.cause = cause
        self.whole = self.whole or lost is None
        if self._start_at is None:
            self._start_at = time.monotonic() + delay
        return True

    def wait_s(self) -> float | None:
        """How long the loop may sleep before ``advance`` has work (None: no restart under way)."""
        if self.cause is None:
            return None
        if self._loading or self._start_at is None:
            return POLL_S
        return min(max(self._start_at - time.monotonic(), 0.0), POLL_S)

    def advance(self) -> bool:
        """One look (never waits for the load): True when the restart ended, with the core(s) serving
        (``cause`` None) or past the budget (``gave_up`` set)."""
        assert self.policy is not None and self.cause is not None
        core = self.engine.core
        try:
            if self._start_at is not None and time.monotonic() >= self._start_at:
                self._start_at = None
                self._made = self.policy.record()
                self._loading = True
                core.start_dead()
            if self._start_at is not None or (self._loading and not core.poll_started()):
                return False
        except BaseException as e:  # noqa: BLE001 - the start-up failed: try again, or give up
            self._loading = False
            delay = self.policy.next_delay()
            logger.error("engine core restart %d failed (%r)%s", self._made, e,
                         "" if delay is None else f"; trying again in {delay:g} s")
            if delay is None:
                self._log_budget_spent()
                self.gave_up = e
                return True
            self._start_at = time.monotonic() + delay
            return False
        self._loading = False
        self.num_restarts += 1
        self.cause, self.whole = None, False
        logger.warning("the engine core is serving again (restart %d of at most %d in %g s)", self._made,
                       self.policy.max_restarts, self.policy.window_s)
        return True

    def _log_budget_spent(self) -> None:
        assert self.policy is not None
        logger.error("the engine core may not restart again (%d restarts in %g s): the engine is dead",
                     self.policy.max_restarts, self.policy.window_s)
