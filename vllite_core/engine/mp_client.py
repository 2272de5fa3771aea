"""MPClient: the EngineCoreClient (core_client.py) whose engine cores run in their own processes.

``LLMEngine(config, core=client)`` runs on top of it as on an in-process core: requests are
prepared and detokenized here (the OutputProcessor stays in the API process, as in vLLM),
``add_request`` sends a request to an engine-core process (core_proc.py), ``step`` returns the next
outputs that arrived, ``stats`` the latest ``SchedulerStats`` records the cores sent with them. With
``data_parallel_size`` N there are N engine cores, each a full copy of the model; a request goes to
the one with the fewest unfinished requests (running + waiting, as this client counts them: sent and
not yet finished or aborted), and /metrics labels each engine's numbers with its index.

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

Across nodes (``DataParallelLayout``, dp_layout.py): ranks past ``size_local`` run on headless nodes,
whose cores connect to the ROUTER this client binds on ``--data-parallel-address``:
``--data-parallel-rpc-port``; they are routed like the local ones. A remote core is ready once its ready
message came; it is dead once its link closes (the process exited, or heartbeats stopped: its node is
gone), seen by a thread watching the ROUTER's link events, which makes the stepping thread probe the
remote cores (a send to a closed link fails). Its requests fail as a local core's do; "starting it
again" is waiting for its node to start a core for that rank, which connects on its own.
"""
from __future__ import annotations

import atexit
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import tempfile
import threading
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import zmq

from vllite_core.config import VlliteConfig
from vllite_core.core.stats import SchedulerStats, combine
from vllite_core.engine.core import CoreInfo, EngineCoreOutput
from vllite_core.engine.core_messages import (
    CallMessage,
    EngineCoreAbort,
    EngineCoreBatch,
    EngineCoreCallResult,
    EngineCoreCollectiveRpc,
    EngineCoreFailed,
    EngineCoreIsSleeping,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    EngineCoreSleep,
    EngineCoreUtility,
    EngineCoreWakeUp,
    EngineMessage,
)
from vllite_core.engine.dp_layout import DataParallelLayout, bind_front_end
from vllite_core.engine.serial_utils import MsgpackDecoder, MsgpackEncoder
from vllite_core.errors import ConfigError, EngineCoreDeadError, EngineDeadError
from vllite_core.request import Request, RequestStatus
from vllite_core.worker.sleep import SleepReport

logger = logging.getLogger("vllite.engine_core_client")

_POLL_MS = 100  # the longest step() waits before it returns (so AsyncLLM's inbox is never starved)
_ROUTES_KEPT = 65536  # request -> engine routes remembered for the per-engine request metrics
_STOP_S = 5.0  # how long close() waits for an engine core to exit before it terminates it
_JOIN_S = 30.0  # how long a ready engine core's input socket may take to be joined to ours
_PROBE_S = 2.0  # after a remote link closed: how long the stepping thread keeps probing the remote cores
_WAITING_LOG_S = 30.0  # start-up: how often the ranks not connected yet are named
_LINK_GONE = "its link to this API server closed (its process exited, or its node stopped answering)"


class EngineStartupError(RuntimeError):
    """An engine-core process failed before it was ready, with an error that could not be re-raised
    as itself (or it died without saying why)."""


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


@dataclass
class _Engine:
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


class MPClient:
    """An EngineCoreClient (core_client.py) that starts ``data_parallel_size`` engine-core processes and
    waits until each is ready (or raises what failed there). ``step`` and the request methods are called
    from one thread (the engine loop); sends are locked, so ``remove_lora`` may come from another."""

    def __init__(self, config: VlliteConfig, data_parallel_size: int = 1,
                 dp: DataParallelLayout | None = None) -> None:
        """``dp``: ranks on other nodes too (its ``size`` is the data-parallel size, ``size_local`` the
        processes started here); without it ``data_parallel_size`` processes here."""
        if data_parallel_size < 1:
            raise ConfigError(f"data_parallel_size: must be at least 1, got {data_parallel_size}")
        dp = dp or DataParallelLayout(data_parallel_size, data_parallel_size)
        self.dp = dp
        self._ctx = zmq.Context()
        self._tag = f"vllite-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._ipc_files: list[str] = []
        self._out = self._ctx.socket(zmq.PULL)
        self._out.setsockopt(zmq.LINGER, 0)
        self._out.bind(self._addr("out"))
        self._inputs = zmq.Poller()  # what the engines send arrives here (and on the front end's ROUTER)
        self._inputs.register(self._out, zmq.POLLIN)
        self._router: zmq.Socket | None = None  # the front end for remote ranks
        self._router_events: zmq.Socket | None = None  # its link events (read by the link watcher thread)
        self._link_watch: threading.Thread | None = None
        self._link_stop: tuple[int, int] | None = None
        self._probe_until = 0.0  # monotonic: probe the remote cores' links while before this
        self._remote_notes: deque[tuple[int, Any]] = deque()  # from other threads, for remote cores (flush sends)
        self._encoder = MsgpackEncoder()
        self._decoder = MsgpackDecoder(EngineMessage)
        self._send_lock = threading.Lock()
        self._closed = False
        self._died: _Engine | None = None
        self._owner: dict[str, _Engine] = {}  # engine request id -> the engine that has it
        self._outbox: dict[int, list[Any]] = {}  # engine index -> messages queued for it (sent by flush)
        self._pending: deque[EngineCoreOutputs] = deque()  # arrived, not yet handed out by step()
        self._routes: OrderedDict[str, int] = OrderedDict()  # recent request ids -> engine index (for metrics)
        self._call_ids = itertools.count()
        self._results: dict[int, EngineCoreCallResult] = {}  # answers to calls, until their caller takes them
        self.on_failure: list[Callable[[], None]] = []  # called (monitor thread) when an engine process exits
        self.restartable = True
        self._config = config
        self._restarts = 0  # times dead engine processes were started again (their socket names differ)
        self._starting: list[_Engine] = []  # started again, not ready yet (poll_started)
        self._monitor: threading.Thread | None = None
        self._monitor_stop: tuple[int, int] | None = None  # the running monitor's stop pipe
        self.engines = [_Engine(i, None, "", remote=i >= dp.size_local) for i in range(dp.size)]
        atexit.register(self.close)
        try:
            if any(e.remote for e in self.engines):
                self._router, self._router_events = bind_front_end(self._ctx, dp)
                self._inputs.register(self._router, zmq.POLLIN)
                self._start_link_watch()
            for e in self.engines:
                if not e.remote:
                    self._spawn(e)
            self._wait_ready(self.engines)
        except BaseException:
            self.close()
            raise
        info = self.engines[0].info
        assert info is not None
        self.info: CoreInfo = info
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._poller = zmq.Poller()
        self._poller.register(self._out, zmq.POLLIN)
        if self._router is not None:
            self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._start_monitor()

    def _spawn(self, eng: _Engine) -> None:
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
                logger.error("%s: %s", eng.describe(), _LINK_GONE)
                self._died = self._died or eng

    def _wait_input(self, timeout_ms: int) -> bool:
        """Whether something arrived from an engine core within ``timeout_ms``."""
        return bool(self._inputs.poll(timeout_ms))

    def _addr(self, name: str) -> str:
        path = os.path.join(tempfile.gettempdir(), f"{self._tag}-{name}")
        if path not in self._ipc_files:
            self._ipc_files.append(path)
        return f"ipc://{path}"

    # ---- start-up -------------------------------------------------------------------------
    def _wait_ready(self, engines: list[_Engine]) -> None:
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

    def _check_started(self, engines: list[_Engine]) -> bool:
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

    def _accept_remote(self, eng: _Engine) -> None:
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

    # ---- what LLMEngine calls ---------------------------------------------------------------
    def _live(self) -> list[_Engine]:
        """The engines that take requests: ready, and not known dead."""
        ready = [e for e in self.engines if e.ready]
        if self._died is None:
            return ready
        dead = self._dead_engines()
        return [e for e in ready if e not in dead]

    def _dead_engines(self) -> list[_Engine]:
        """Engines that served and died (not the ones starting again, nor those whose start failed)."""
        return [e for e in self.engines if e is self._died or (e.ready and not e.alive())]

    def _queue(self, eng: _Engine, msg: Any) -> None:
        """Sent with the others queued before the next ``step`` (or ``flush``), as one message."""
        self._outbox.setdefault(eng.index, []).append(msg)

    def flush(self) -> None:
        while self._remote_notes:
            index, note = self._remote_notes.popleft()
            self._queue(self.engines[index], note)
        outbox, self._outbox = self._outbox, {}
        for index, msgs in outbox.items():
            eng = self.engines[index]
            if eng is self._died or not eng.ready:
                continue  # its requests fail with it; a starting engine has none (and a fresh cache)
            if not self._send(eng, msgs) and self._died is None:
                self._died = eng

    def _send(self, eng: _Engine, msgs: list[Any]) -> bool:
        """Never blocks: False when the engine is not connected (not started yet, or gone)."""
        with self._send_lock:
            try:
                frames = self._encoder.encode(EngineCoreBatch(msgs))
                if eng.remote:
                    if eng.identity is None or self._router is None:
                        return False
                    self._router.send_multipart([eng.identity, *frames], flags=zmq.NOBLOCK, copy=False)
                else:
                    eng.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                eng.sent += len(msgs)
                return True
            except zmq.Again:
                return False
            except zmq.ZMQError as e:
                if not eng.remote or e.errno != zmq.EHOSTUNREACH:
                    raise
                eng.gone = eng.gone or _LINK_GONE
                return False

    def add_request(self, request: Request) -> None:
        self._probe_remote()
        live = self._live()
        if not live:
            self._raise_if_dead()
            raise EngineDeadError("no engine core is serving: every one is starting again")
        lora = pickle.dumps(request.lora_request) if request.lora_request is not None else None
        pooling = pickle.dumps(request.pooling_params) if request.pooling_params is not None else None
        msg = EngineCoreRequest(request.request_id, list(request.prompt_token_ids),
                                pickle.dumps(request.sampling_params), request.eos_token_id, request.priority,
                                request.arrival_time, request.max_tokens, request.encoder_inputs,
                                request.num_encoder_tokens, request.cache_salt, tuple(request.block_extra_keys),
                                pooling, lora, pickle.dumps(request.mm_features) if request.mm_features else None)
        eng = min(live, key=lambda e: (e.unfinished, e.index))
        self._queue(eng, msg)
        self._owner[request.request_id] = eng
        eng.unfinished += 1
        rid = request.request_id
        self._routes[rid] = eng.index
        if "#" in rid:  # a parallel-sampling child "id#i": its parent is what the API reports on
            self._routes[rid.rpartition("#")[0]] = eng.index
        while len(self._routes) > _ROUTES_KEPT:
            self._routes.popitem(last=False)

    def engine_of(self, request_id: str) -> int:
        """The engine index a (recent) request was sent to; 0 when unknown."""
        return self._routes.get(request_id, 0)

    def _forget(self, request_ids: Iterable[str]) -> dict[int, list[str]]:
        by_engine: dict[int, list[str]] = {}
        for rid in request_ids:
            eng = self._owner.pop(rid, None)
            if eng is not None:
                eng.unfinished -= 1
                by_engine.setdefault(eng.index, []).append(rid)
        return by_engine

    def abort_requests(self, request_ids: list[str]) -> None:
        for index, ids in self._forget(request_ids).items():
            self._queue(self.engines[index], EngineCoreAbort(ids))

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """Only the API's stop-string check finishes a request from this side: it stops in the engine."""
        for index, ids in self._forget([request_id]).items():
            self._queue(self.engines[index], EngineCoreAbort(ids, stopped=True))

    def has_unfinished_requests(self) -> bool:
        """Requests in flight, or messages (aborts) whose effect on the engine's numbers is not back yet."""
        return (bool(self._owner) or bool(self._pending) or bool(self._outbox) or self._died is not None
                or any(e.applied < e.sent for e in self.engines) or time.monotonic() < self._probe_until)

    def get_num_unfinished_requests(self) -> int:
        """Requests sent and not yet finished or aborted, as this client counts them."""
        return len(self._owner)

    def reset_prefix_cache(self) -> bool:
        """Ask every engine core to forget its cached prefixes (sent with the next step)."""
        for eng in self.engines:
            self._queue(eng, EngineCoreUtility("reset_prefix_cache"))
        return True

    def remove_lora(self, lora_int_id: int) -> None:
        """Drop an adapter from every engine's cache (running requests keep the one they hold)."""
        for eng in self.engines:  # from another thread: sent at once, on its own
            if eng.remote:  # the ROUTER is the stepping thread's: it sends this with the next step
                self._remote_notes.append((eng.index, EngineCoreUtility("remove_lora", [lora_int_id])))
                self.wake()
            elif self._died is None and eng.ready:
                self._send(eng, [EngineCoreUtility("remove_lora", [lora_int_id])])

    # ---- answered calls: sleep mode, collective_rpc ------------------------------------------------
    def _call(self, make: Callable[[int], CallMessage]) -> list[Any]:
        """Send ``make(call_id)`` to every engine core (after what is queued) and wait for the answers;
        each core's value in engine order. A call that raised there raises here (the engine goes on).
        Called from the thread that steps (outputs arriving meanwhile are kept for ``step``)."""
        self.flush()
        self._raise_if_dead()
        ids = []
        for eng in self.engines:
            call_id = next(self._call_ids)
            if not self._send(eng, [make(call_id)]):
                self._died = self._died or eng
                self._raise_if_dead()
            ids.append(call_id)
        while not all(i in self._results for i in ids):
            self._raise_if_dead()
            if self._wait_input(_POLL_MS):
                self._drain()
        answers = [self._results.pop(i) for i in ids]
        for a in answers:
            if a.error is not None:
                if isinstance(a.error, BaseException):
                    raise a.error
                raise RuntimeError(f"engine core {a.engine_index}: {a.text}")
        return [pickle.loads(a.value) for a in answers]

    def sleep(self, level: int) -> list[SleepReport]:
        return [r for rs in self._call(lambda i: EngineCoreSleep(i, level)) for r in rs]

    def wake_up(self, tags: list[str] | None) -> None:
        self._call(lambda i: EngineCoreWakeUp(i, tags))

    def is_sleeping(self) -> bool:
        return any(self._call(EngineCoreIsSleeping))

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple,
                       kwargs: dict[str, Any] | None) -> list[Any]:
        """Every rank's result, engine core by engine core. A function travels cloudpickled."""
        if callable(method):
            import cloudpickle

            name, function = None, cloudpickle.dumps(method)
        elif isinstance(method, str):
            name, function = method, None
        else:
            raise TypeError(f"method: a worker method's name or a function, got {type(method).__name__}")
        payload, kw = pickle.dumps(tuple(args)), pickle.dumps(dict(kwargs or {}))
        return [r for rs in self._call(lambda i: EngineCoreCollectiveRpc(i, name, function, payload, kw))
                for r in rs]

    def step(self) -> list[EngineCoreOutput]:
        """One engine step's outputs (maybe none, after _POLL_MS without news); EngineDeadError once an
        engine is gone. One step per call, as in-process, so each step's tokens reach the streams (and the
        inter-token metrics) as a step of their own even when several arrived together."""
        self.flush()
        self._probe_remote()
        self._raise_if_dead()
        if not self._pending:
            events = dict(self._poller.poll(_POLL_MS))
            if self._wake_r in events:
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
            if self._out in events or (self._router is not None and self._router in events):
                self._drain()
        while self._pending:
            msg = self._pending.popleft()
            eng = self.engines[msg.engine_index]
            eng.stats = msg.stats
            eng.applied = msg.num_applied
            for out in msg.outputs:
                if out.finish_reason is not None and self._owner.get(out.request_id) is eng:
                    del self._owner[out.request_id]
                    eng.unfinished -= 1
            if msg.stepped or msg.outputs:
                return msg.outputs
        self._raise_if_dead()
        return []

    def _drain(self) -> None:
        """Everything that arrived, in order, into ``_pending`` (a failure report marks its engine dead)."""
        while True:
            try:
                frames = self._out.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            msg = self._decoder.decode([f.buffer for f in frames])
            self._take(self.engines[msg.engine_index], msg)
        while self._router is not None:
            try:
                frames = self._router.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                msg = self._decoder.decode([f.buffer for f in frames[1:]])
            except Exception as e:  # noqa: BLE001 - a peer on the network that is no engine core of ours
                logger.warning("a message on %s that is no engine core's was dropped: %r", self.dp.front_end, e)
                continue
            eng = self.engines[msg.engine_index] if 0 <= msg.engine_index < len(self.engines) else None
            if eng is None or not eng.remote:
                logger.warning("a core connected to %s as data-parallel rank %d, which is not a remote rank "
                               "here (ranks %d-%d): ignored", self.dp.front_end, msg.engine_index,
                               self.dp.size_local, self.dp.size - 1)
                continue
            identity = frames[0].bytes
            if not eng.ready and isinstance(msg, (EngineCoreReady, EngineCoreFailed)):
                eng.identity, eng.gone = identity, None
                try:
                    eng.node = frames[1].get("Peer-Address")
                except (zmq.ZMQError, AttributeError):
                    eng.node = "another node"
            elif identity != eng.identity:  # a late word of a replaced core, or a second core for the rank
                if isinstance(msg, EngineCoreReady):
                    logger.warning("a second core connected as data-parallel rank %d (%s serves it): ignored",
                                   eng.index, eng.describe())
                continue
            self._take(eng, msg)

    def _take(self, eng: _Engine, msg: Any) -> None:
        if not eng.ready:
            self._starting_message(eng, msg)
        elif isinstance(msg, EngineCoreFailed):
            eng.last_error = msg.text
            if eng.remote:
                eng.gone = "it reported a failed step"
            else:
                eng.proc.join(5)
            self._died = self._died or eng
        elif isinstance(msg, EngineCoreOutputs):
            self._pending.append(msg)
        elif isinstance(msg, EngineCoreCallResult):
            self._results[msg.call_id] = msg

    def _starting_message(self, eng: _Engine, msg: Any) -> None:
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

    # ---- statistics ---------------------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        return combine([e.stats for e in self.engines])

    def engine_stats(self) -> list[SchedulerStats]:
        return [e.stats for e in self.engines]

    def num_kv_blocks(self) -> int:
        return self.info.model_info.num_kv_blocks * len(self.engines)

    def layout(self) -> dict[str, Any]:
        return {"api_pid": os.getpid(), "data_parallel_size": len(self.engines),
                "engine_cores": [{"dp_rank": e.index, "pid": e.pid, "node": e.node, "remote": True} if e.remote
                                 else {"dp_rank": e.index, "pid": e.pid or e.proc.pid} for e in self.engines]}

    # ---- death and shutdown -------------------------------------------------------------------
    def wake(self) -> None:
        """Make a waiting ``step`` return now (AsyncLLM has new requests or aborts to send)."""
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass

    def _watch(self, watched: dict[Any, tuple[_Engine, Any]], stop_r: int) -> None:
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

    def _report_failure(self) -> None:
        """From a watcher thread: wake the stepping thread and whoever waits on it (``on_failure``)."""
        self.wake()
        for cb in self.on_failure:
            try:
                cb()
            except Exception:
                logger.exception("engine failure callback failed")

    def shutdown(self) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop_monitor()
        if self._link_stop is not None and self._link_watch is not None:
            os.write(self._link_stop[1], b"x")
            self._link_watch.join(10)
        started = [e for e in self.engines if e.proc is not None]  # a failed spawn leaves the later ones None
        for eng in started:
            if eng.proc.is_alive() and eng.sock is not None:
                try:
                    self._send(eng, [EngineCoreUtility("shutdown")])
                except zmq.ZMQError:
                    pass
        for eng in started:
            if eng.proc.pid is None:
                continue
            eng.proc.join(_STOP_S)
            if eng.proc.is_alive():
                eng.proc.terminate()
                eng.proc.join(2)
            if eng.proc.is_alive():
                eng.proc.kill()
                eng.proc.join(2)
        for eng in self.engines:
            if eng.sock is not None:
                eng.sock.close(0)
        self._out.close(0)
        if self._router is not None and self._router_events is not None:
            self._router.disable_monitor()
            self._router_events.close(0)
            self._router.close(0)
        self._ctx.term()
        for path in self._ipc_files:
            try:
                os.unlink(path)
            except OSError:
                pass
        atexit.unregister(self.close)

