"""The engine-core processes behind MPClient (mp_client.py): starting them, knowing when they serve, seeing them
die, and starting them again. MPClient inherits ``CoreProcesses``; routing, steps and calls stay there.

Death: a monitor thread waits on the processes' sentinels. When one exits (a crash, kill -9,
the OOM killer), ``step`` raises ``EngineDeadError`` naming the process, its exit code or
signal and the last error line it sent, so AsyncLLM fails every open request with it. With data
parallelism, while other cores live, it raises ``EngineCoreDeadError`` carrying the dead core's request
ids: only those fail and the live cores keep theirs.

Restart, in three calls that never wait for a model load (so the thread that steps the live cores
goes on stepping them while a dead one loads): ``drop_dead`` forgets the dead cores' requests (the
caller failed them), ``start_dead`` starts their processes again, ``poll_started`` says whether they
are ready (and raises what their start-up raised). A core is *ready* (takes requests) from its
ready message until it dies; a starting one gets none. AsyncLLM decides whether and when to restart,
within its restart budget (engine/restart.py).

A remote core (a rank on a headless node) is ready once its ready message came on the front end; it is
dead once its link closes (the process exited, or heartbeats stopped: its node is gone), seen by a thread
watching the ROUTER's link events, which makes the stepping thread probe the remote cores (a send to a
closed link fails). "Starting it again" is waiting for its node to start a core for that rank.
"""
from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import zmq

from vllite_core.config import VlliteConfig
from vllite_core.core.stats import SchedulerStats
from vllite_core.engine.core import CoreInfo
from vllite_core.engine.core_messages import EngineCoreAbort, EngineCoreFailed, EngineCoreOutputs, EngineCoreReady
from vllite_core.engine.dp_layout import DataParallelLayout
from vllite_core.engine.dp_routing import PrefixRouter
from vllite_core.errors import EngineCoreDeadError, EngineDeadError
from vllite_core.utils import describe_exit

logger = logging.getLogger("vllite.engine_core_client")

_JOIN_S = 30.0  # how long a ready engine core's input socket may take to be joined to ours
_PROBE_S = 2.0  # after a remote link closed: how long the stepping thread keeps probing the remote cores
_WAITING_LOG_S = 30.0  # start-up: how often the ranks not connected yet are named
LINK_GONE = "its link to this API server closed (its process exited, or its node stopped answering)"


class EngineStartupError(RuntimeError):
    """An engine-core process failed before it was ready, with an error that could not be re-raised
    as itself (or it died without saying why)."""


@dataclass
class CoreSlot:
    """One data-parallel rank's engine core as MPClient knows it: its process here, or its link (remote)."""

    index: int
    proc: Any  # multiprocessing.Process
    input_addr: str
    sock: Any = None  # zmq PUSH to this engine
    pid: int | None = None
    stats: SchedulerStats = field(default_factory=SchedulerStats)
    unfinished: int = 0  # requests sent, not yet finished or aborted
    sent: int = 0  # messages sent to it
    applied: int = 0  # messages it said it applied (its stats are current once this equals sent)
    last_error: str | None = None  # the last error line the process sent (EngineCoreFailed)
    ready: bool = False  # serving: its ready message came and its input socket is joined; False once dead
    info: CoreInfo | None = None  # what its ready message said (start-up)
    joined_by: float = 0.0  # start-up: monotonic deadline for its input socket to be joined after "ready"
    start_error: BaseException | None = None  # start-up: what its process reported failing with
    remote: bool = False  # on another node: its core connected to our front end (no process of ours)
    identity: bytes | None = None  # remote: the routing id of its link (a new one for each process)
    node: str | None = None  # remote: the address its link comes from
    gone: str | None = None  # remote: why it is dead (its link closed, or it reported a failed step)

    def describe(self) -> str:
        pid = self.pid or (self.proc.pid if self.proc is not None else "?")
        return f"engine core {self.index} (pid {pid}" + (f" on {self.node})" if self.node else ")")

    def alive(self) -> bool:
        if self.remote:
            return self.gone is None
        return self.proc is not None and self.proc.is_alive()

    def exit_text(self) -> str:
        return (self.gone or "still running") if self.remote else describe_exit(self.proc.exitcode)


class CoreProcesses:
    """The lifecycle half of MPClient: what it holds of the processes (set up by ``MPClient.__init__``) and
    the methods that start, watch, reap and restart them. Sends and reads are MPClient's (``_send``,
    ``_drain``, ``_wait_input``, ``_addr``, ``wake``)."""

    engines: list[CoreSlot]
    dp: DataParallelLayout
    on_failure: list[Callable[[], None]]
    _config: VlliteConfig
    _ctx: zmq.Context
    _closed: bool
    _died: CoreSlot | None
    _owner: dict[str, CoreSlot]
    _outbox: dict[int, list[Any]]
    _pending: deque[EngineCoreOutputs]
    _restarts: int
    _starting: list[CoreSlot]
    _monitor: threading.Thread | None
    _monitor_stop: tuple[int, int] | None
    _router_events: zmq.Socket | None
    _link_watch: threading.Thread | None
    _link_stop: tuple[int, int] | None
    _probe_until: float
    _prefix_router: PrefixRouter | None

    # ---- processes and watchers ---------------------------------------------------------------------
    def _spawn(self, eng: CoreSlot) -> None:
        """Start engine ``eng.index``'s process, with a fresh input socket (nothing queued for a dead one)."""
        from vllite_core.engine.core_proc import run_engine_core

        if eng.sock is not None:
            eng.sock.close(0)
        eng.input_addr = self._addr(f"in{eng.index}" + (f"-r{self._restarts}" if self._restarts else ""))
        mp = multiprocessing.get_context("spawn")
        eng.proc = mp.Process(target=run_engine_core, args=(self._config, eng.index, eng.input_addr, self._addr("out")),
                              name=f"VlliteEngineCore_{eng.index}", daemon=False)
        eng.proc.start()
        eng.pid = None
        eng.ready, eng.info, eng.start_error = False, None, None
        eng.sock = self._ctx.socket(zmq.PUSH)
        eng.sock.setsockopt(zmq.LINGER, 0)
        eng.sock.setsockopt(zmq.SNDHWM, 0)  # no limit: a send fails (never blocks) only without a peer
        eng.sock.bind(eng.input_addr)

    def _start_monitor(self) -> None:
        """(Re)start the monitor on the processes of the ready and the starting engines."""
        self._stop_monitor()
        watched = {e.proc.sentinel: (e, e.proc) for e in self.engines
                   if (e.ready or e in self._starting) and not e.remote and e.proc.exitcode is None}
        self._monitor_stop = os.pipe()
        self._monitor = threading.Thread(target=self._watch, args=(watched, self._monitor_stop[0]),
                                         name="vllite-engine-monitor", daemon=True)
        self._monitor.start()

    def _stop_monitor(self) -> None:
        if self._monitor is None or self._monitor_stop is None:
            return
        r, w = self._monitor_stop
        os.write(w, b"x")
        if self._monitor is not threading.current_thread():
            self._monitor.join(10)
        if not self._monitor.is_alive():
            os.close(r)
            os.close(w)
        self._monitor = self._monitor_stop = None

    def _watch(self, watched: dict[Any, tuple[CoreSlot, Any]], stop_r: int) -> None:
        """The monitor thread: a ready engine's process exiting is a death (``step`` raises it); a
        starting one's is a failed start-up (``poll_started`` raises it): either wakes the stepping thread."""
        while watched:
            ready = multiprocessing.connection.wait([*watched, stop_r])
            if self._closed or stop_r in ready:
                return
            for s in ready:
                eng, proc = watched.pop(s)
                if eng.proc is not proc:  # restart outran this monitor: the engine already runs a new process
                    continue
                if not eng.ready:
                    self.wake()
                    continue
                eng.proc.join(5)  # its pipe closes a moment before it can be reaped (the exit code known)
                logger.error("%s exited (%s)", eng.describe(), describe_exit(eng.proc.exitcode))
                self._died = self._died or eng
                self._report_failure()
                return

    def _start_link_watch(self) -> None:
        """A thread that wakes the stepping thread when a link of the front end closes: which core's it
        was, ``_probe_remote`` finds out there (the ROUTER is that thread's)."""
        self._link_stop = os.pipe()
        events, stop_r = self._router_events, self._link_stop[0]

        def watch() -> None:
            poller = zmq.Poller()
            poller.register(events, zmq.POLLIN)
            poller.register(stop_r, zmq.POLLIN)
            while not self._closed:
                ready = dict(poller.poll())
                if stop_r in ready or self._closed:
                    return
                events.recv_multipart()
                self._probe_until = time.monotonic() + _PROBE_S
                self._report_failure()

        self._link_watch = threading.Thread(target=watch, name="vllite-front-end-links", daemon=True)
        self._link_watch.start()

    def _probe_remote(self) -> None:
        """While a front-end link closed lately: a serving remote core whose link is gone is dead (an
        empty batch cannot be routed to it)."""
        if time.monotonic() >= self._probe_until:
            return
        for eng in self.engines:
            if eng.remote and eng.ready and eng.gone is None and not self._send(eng, []):
                logger.error("%s: %s", eng.describe(), LINK_GONE)
                self._died = self._died or eng

    def _report_failure(self) -> None:
        """From a watcher thread: wake the stepping thread and whoever waits on it (``on_failure``)."""
        self.wake()
        for cb in self.on_failure:
            try:
                cb()
            except Exception:
                logger.exception("engine failure callback failed")

    # ---- start-up -------------------------------------------------------------------------
    def _wait_ready(self, engines: list[CoreSlot]) -> None:
        """Until every one of ``engines`` is ready; the first start-up failure is raised as the error the
        process hit. Outputs other (running) engines send meanwhile are kept."""
        named = time.monotonic()
        while True:
            self._drain()
            if self._check_started(engines):
                return
            if time.monotonic() - named > _WAITING_LOG_S:
                named = time.monotonic()
                logger.warning("waiting for data-parallel rank(s) %s to connect to %s",
                               ", ".join(str(e.index) for e in engines if e.remote and not e.ready),
                               self.dp.front_end)
            self._wait_input(200)

    def _check_started(self, engines: list[CoreSlot]) -> bool:
        """Whether every one of ``engines`` is ready now (never waits); raises the first start-up failure.
        Their ready and failure messages are read by ``_drain``."""
        for eng in engines:
            if eng.ready:
                continue
            if eng.start_error is not None:
                raise eng.start_error
            if eng.remote:
                if eng.info is not None:
                    self._accept_remote(eng)
                continue
            if eng.proc.exitcode is not None:
                if self._wait_input(200):  # the error it sent before it exited may still be on its way
                    self._drain()
                if eng.start_error is not None:
                    raise eng.start_error
                raise EngineStartupError(f"{eng.describe()} failed to start: it exited "
                                         f"({describe_exit(eng.proc.exitcode)}) before it was ready")
            if eng.info is None:
                continue
            # zmq joins the sockets in the background: "ready" can arrive before the engine's input socket is
            # joined to ours, and a send in that gap fails as if the engine were gone (seen on a loaded host)
            if eng.sock.poll(0, zmq.POLLOUT):
                eng.ready = True
            elif time.monotonic() > eng.joined_by:
                eng.info = None  # this start is over: a later ready message starts the wait again
                raise EngineStartupError(f"{eng.describe()} failed to start: its input socket was not joined "
                                         f"in {_JOIN_S:g} s")
        return all(e.ready for e in engines)

    def _starting_message(self, eng: CoreSlot, msg: Any) -> None:
        """A message from an engine that is not ready: its start-up's outcome (anything else is a late
        word of the process it replaces, dropped)."""
        if isinstance(msg, EngineCoreReady):
            eng.pid = msg.pid
            eng.stats = msg.stats
            eng.info = pickle.loads(msg.info)
            eng.joined_by = time.monotonic() + _JOIN_S
        elif isinstance(msg, EngineCoreFailed):
            eng.start_error = (msg.error if isinstance(msg.error, BaseException)
                               else EngineStartupError(f"{eng.describe()} failed to start: {msg.text}"))

    def _accept_remote(self, eng: CoreSlot) -> None:
        """A remote core's ready message came on its link (so the link is up): it serves, unless it runs
        another model than the cores already serving."""
        assert eng.info is not None
        ref = next((e.info for e in self.engines if e.ready and e.info is not None), None)
        theirs = (eng.info.model_cls.__name__, eng.info.vocab_size)
        if ref is not None and (ref.model_cls.__name__, ref.vocab_size) != theirs:
            eng.info = None
            raise EngineStartupError(
                f"{eng.describe()} serves {theirs[0]} (vocabulary {theirs[1]}) where the other cores serve "
                f"{ref.model_cls.__name__} (vocabulary {ref.vocab_size}): every node must be started with the "
                "same model and options")
        eng.ready = True
        logger.warning("%s connected from %s", eng.describe(), eng.node)

    # ---- death -------------------------------------------------------------------------------------
    def _dead_engines(self) -> list[CoreSlot]:
        """Engines that served and died (not the ones starting again, nor those whose start failed)."""
        return [e for e in self.engines if e is self._died or (e.ready and not e.alive())]

    def _raise_if_dead(self) -> None:
        eng = self._died
        if eng is None:
            return
        if eng.last_error is None:
            try:
                self._drain()  # the last words it may have sent before it exited
            except zmq.ZMQError:
                pass
        dead = self._dead_engines()
        if any(e.ready and e not in dead for e in self.engines):  # data parallel: the others serve on
            raise EngineCoreDeadError(self.death_cause(),
                                      frozenset(rid for rid, owner in self._owner.items() if owner in dead))
        raise EngineDeadError(self.death_cause())

    def death_cause(self) -> str:
        eng = self._died
        if eng is None:
            return ""
        text = f"{eng.describe()} died: {eng.exit_text()}"
        if eng.last_error:
            text += f"; its last error: {eng.last_error}"
        return text

    # ---- restart ---------------------------------------------------------------------------------
    def drop_dead(self, keep_live: bool = False) -> None:
        """After a death the caller has seen (and failed the requests of): reap the dead process(es) and
        forget every request sent before, engines still running (data parallel) aborting theirs;
        ``keep_live``: only the dead cores' requests are forgotten, live cores keep theirs and their
        outputs and serve on. Nothing starts yet (``start_dead``)."""
        dead = self._dead_engines()
        partial = keep_live and any(e.ready and e not in dead for e in self.engines)
        for eng in dead:
            if eng.remote:  # forgotten before the drain: a ready message of its successor may be in it
                eng.ready, eng.identity, eng.info, eng.pid, eng.node, eng.gone = False, None, None, None, None, None
                continue
            eng.proc.join(5)
            if eng.proc.is_alive():  # it reported a failed step and hangs on its way out
                eng.proc.kill()
                eng.proc.join(5)
        try:
            self._drain()  # the dead process's last messages
        except zmq.ZMQError:
            pass
        for eng in dead:
            eng.ready = False
        if partial:
            gone = {e.index for e in dead}
            self._pending = deque(m for m in self._pending if m.engine_index not in gone)
            for eng in dead:
                self._outbox.pop(eng.index, None)
                eng.unfinished = 0
            self._owner = {rid: owner for rid, owner in self._owner.items() if owner not in dead}
        else:
            self._pending.clear()
            self._outbox.clear()
            for eng in self.engines:
                ids = [rid for rid, owner in self._owner.items() if owner is eng]
                if ids and eng.ready:
                    self._send(eng, [EngineCoreAbort(ids)])
                eng.unfinished = 0
            self._owner.clear()
        for eng in dead:
            eng.sent = eng.applied = 0
            eng.last_error = None
            eng.stats = SchedulerStats()
            if self._prefix_router is not None:  # its prefix cache died with it
                self._prefix_router.forget_engine(eng.index)
        self._died = None
        self._start_monitor()  # on the live engines: the dead one's death is not reported again

    def start_dead(self) -> None:
        """Start again every engine that is neither ready nor starting (from the config: the model loads
        again); ``poll_started`` says when they serve."""
        down = [e for e in self.engines if not e.ready and e not in self._starting]
        if not down:
            return
        self._restarts += 1
        for eng in down:
            eng.sent = eng.applied = 0
            eng.last_error = None
            eng.stats = SchedulerStats()
            if eng.remote:  # its node starts it: its ready message may even be here already
                logger.warning("engine core %d: waiting for its node to start it again (it connects to %s)",
                               eng.index, self.dp.front_end)
                continue
            logger.warning("%s: starting again", eng.describe())
            self._spawn(eng)
        self._starting += down
        self._start_monitor()

    def poll_started(self, wait_s: float = 0.0) -> bool:
        """Whether the engines ``start_dead`` started are all ready (waiting at most ``wait_s`` for news).
        A start-up failure is raised as the error the process hit; its engines are stopped and down
        again (a later ``start_dead`` tries again)."""
        if not self._starting:
            return True
        if wait_s > 0:
            self._wait_input(int(wait_s * 1000))
        try:
            self._drain()
            if not self._check_started(self._starting):
                return False
        except BaseException:
            for eng in self._starting:
                eng.ready = False
                if eng.remote:
                    continue
                if eng.proc.is_alive():
                    eng.proc.kill()
                eng.proc.join(5)
            self._starting = []
            raise
        started, self._starting = self._starting, []
        logger.warning("engine core(s) %s serving again (pid %s)", ", ".join(str(e.index) for e in started),
                       ", ".join(str(e.pid) for e in started))
        return True
