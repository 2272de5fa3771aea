"""MPClient: the EngineCoreClient (core_client.py) whose engine cores run in their own processes.

``LLMEngine(config, core=client)`` runs on top of it as on an in-process core: requests are
prepared and detokenized here (the OutputProcessor stays in the API process, as in vLLM),
``add_request`` sends a request to an engine-core process (core_proc.py), ``step`` returns the next
outputs that arrived, ``stats`` the latest ``SchedulerStats`` records the cores sent with them. With
``data_parallel_size`` N there are N engine cores, each a full copy of the model; a request goes to
the one with the fewest unfinished requests (running + waiting, as this client counts them: sent and
not yet finished or aborted), or, with prefix caching on, to the one that holds its prompt's prefix while
that one's load stays close (dp_routing.py); /metrics labels each engine's numbers with its index.

The processes' lifecycle (start-up, death, restart) is ``CoreProcesses`` (core_processes.py), which
MPClient inherits.

Across nodes (``DataParallelLayout``, dp_layout.py): ranks past ``size_local`` run on headless nodes,
whose cores connect to the ROUTER this client binds on ``--data-parallel-address``:
``--data-parallel-rpc-port``; they are routed like the local ones, and their requests fail as a local
core's do when their link closes.
"""
from __future__ import annotations

import atexit
import itertools
import logging
import os
import pickle
import tempfile
import threading
import time
import uuid
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Any, Callable, Iterable

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
from vllite_core.engine.core_processes import LINK_GONE, CoreProcesses, CoreSlot
from vllite_core.engine.dp_layout import DataParallelLayout, bind_front_end
from vllite_core.engine.dp_routing import PrefixRouter
from vllite_core.engine.restart import RestartPolicy
from vllite_core.engine.serial_utils import MsgpackDecoder, MsgpackEncoder
from vllite_core.errors import ConfigError, EngineDeadError
from vllite_core.request import Request, RequestStatus
from vllite_core.worker.sleep import SleepReport

if TYPE_CHECKING:
    from vllite_core.engine.dp_ray import RayDataParallelRanks

logger = logging.getLogger("vllite.engine_core_client")

_POLL_MS = 100  # the longest step() waits before it returns (so AsyncLLM's inbox is never starved)
_ROUTES_KEPT = 65536  # request -> engine routes remembered for the per-engine request metrics
_STOP_S = 5.0  # how long close() waits for an engine core to exit before it terminates it


class MPClient(CoreProcesses):
    """An EngineCoreClient (core_client.py) that starts ``data_parallel_size`` engine-core processes and
    waits until each is ready (or raises what failed there). ``step`` and the request methods are called
    from one thread (the engine loop); sends are locked, so ``remove_lora`` may come from another."""

    def __init__(self, config: VlliteConfig, data_parallel_size: int = 1,
                 dp: DataParallelLayout | None = None, restart: RestartPolicy | None = None) -> None:
        """``dp``: ranks on other nodes too (its ``size`` is the data-parallel size, ``size_local`` the
        processes started here); without it ``data_parallel_size`` processes here. ``restart``: the server's
        restart policy, which the ranks it places on a Ray cluster apply to their own engine cores (None: none)."""
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
        self._ray_ranks: RayDataParallelRanks | None = None  # remote ranks this client placed on Ray
        self._router_events: zmq.Socket | None = None  # its link events (read by the link watcher thread)
        self._link_watch: threading.Thread | None = None
        self._link_stop: tuple[int, int] | None = None
        self._probe_until = 0.0  # monotonic: probe the remote cores' links while before this
        self._remote_notes: deque[tuple[int, Any]] = deque()  # from other threads, for remote cores (flush sends)
        self._encoder = MsgpackEncoder()
        self._decoder = MsgpackDecoder(EngineMessage)
        self._send_lock = threading.Lock()
        self._closed = False
        self._died: CoreSlot | None = None
        self._owner: dict[str, CoreSlot] = {}  # engine request id -> the engine that has it
        self._outbox: dict[int, list[Any]] = {}  # engine index -> messages queued for it (sent by flush)
        self._pending: deque[EngineCoreOutputs] = deque()  # arrived, not yet handed out by step()
        self._routes: OrderedDict[str, int] = OrderedDict()  # recent request ids -> engine index (for metrics)
        self._call_ids = itertools.count()
        self._results: dict[int, EngineCoreCallResult] = {}  # answers to calls, until their caller takes them
        self.on_failure: list[Callable[[], None]] = []  # called (monitor thread) when an engine process exits
        self.restartable = True
        self._config = config
        self._restarts = 0  # times dead engine processes were started again (their socket names differ)
        self._starting: list[CoreSlot] = []  # started again, not ready yet (poll_started)
        self._monitor: threading.Thread | None = None
        self._monitor_stop: tuple[int, int] | None = None  # the running monitor's stop pipe
        self.engines = [CoreSlot(i, None, "", remote=i >= dp.size_local) for i in range(dp.size)]
        atexit.register(self.close)
        try:
            if any(e.remote for e in self.engines):
                self._router, self._router_events = bind_front_end(self._ctx, dp)
                self._inputs.register(self._router, zmq.POLLIN)
                self._start_link_watch()
                if dp.backend == "ray":
                    from vllite_core.engine.dp_ray import RayDataParallelRanks

                    self._ray_ranks = RayDataParallelRanks(config, dp, restart or RestartPolicy(max_restarts=0))
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
        cache = info.config.cache_config
        self._prefix_router = PrefixRouter(cache.block_size) if dp.size > 1 and cache.enable_prefix_caching \
            else None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._poller = zmq.Poller()
        self._poller.register(self._out, zmq.POLLIN)
        if self._router is not None:
            self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._start_monitor()

    def _wait_input(self, timeout_ms: int) -> bool:
        """Whether something arrived from an engine core within ``timeout_ms``."""
        return bool(self._inputs.poll(timeout_ms))

    def _addr(self, name: str) -> str:
        path = os.path.join(tempfile.gettempdir(), f"{self._tag}-{name}")
        if path not in self._ipc_files:
            self._ipc_files.append(path)
        return f"ipc://{path}"

    # ---- what LLMEngine calls ---------------------------------------------------------------
    def _live(self) -> list[CoreSlot]:
        """The engines that take requests: ready, and not known dead."""
        ready = [e for e in self.engines if e.ready]
        if self._died is None:
            return ready
        dead = self._dead_engines()
        return [e for e in ready if e not in dead]

    def _queue(self, eng: CoreSlot, msg: Any) -> None:
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

    def _send(self, eng: CoreSlot, msgs: list[Any]) -> bool:
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
                eng.gone = eng.gone or LINK_GONE
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
        eng = self._choose_engine(live, request)
        self._queue(eng, msg)
        self._owner[request.request_id] = eng
        eng.unfinished += 1
        rid = request.request_id
        self._routes[rid] = eng.index
        if "#" in rid:  # a parallel-sampling child "id#i": its parent is what the API reports on
            self._routes[rid.rpartition("#")[0]] = eng.index
        while len(self._routes) > _ROUTES_KEPT:
            self._routes.popitem(last=False)

    def _choose_engine(self, live: list[CoreSlot], request: Request) -> CoreSlot:
        """The least loaded engine core, or (prefix caching on, several cores) the one that holds the
        prompt's prefix while its load stays close (dp_routing.py)."""
        if self._prefix_router is None or len(live) == 1:
            return min(live, key=lambda e: (e.unfinished, e.index))
        lora = request.lora_request.lora_name if request.lora_request is not None else None
        keys = self._prefix_router.prefix_keys(request.prompt_token_ids,
                                               (request.cache_salt, lora, tuple(request.block_extra_keys)))
        by_index = {e.index: e for e in live}
        return by_index[self._prefix_router.choose(keys, {i: e.unfinished for i, e in by_index.items()})]

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

    def _take(self, eng: CoreSlot, msg: Any) -> None:
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

    # ---- wake and shutdown -------------------------------------------------------------------
    def wake(self) -> None:
        """Make a waiting ``step`` return now (AsyncLLM has new requests or aborts to send)."""
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass

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
        if self._ray_ranks is not None:  # after the local cores' shutdown: the remote ones stop with their actors
            self._ray_ranks.stop()
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

