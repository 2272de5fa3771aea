"""The ``mp`` executor: one worker process per tensor-parallel rank on this machine.

Each worker is a fresh interpreter (``python -m vllite_core.executor.mp_worker``), not a fork: the
engine process may hold threads and device state, and a spawned child would re-run the user's
script. A socket pair links the engine to each worker; every call is pickled once and sent to all
ranks, which join one torch.distributed group (the platform's ``dist_backend``) for the model's
collectives. A worker that dies (its socket closes) or raises fails the call with
``WorkerDiedError`` naming the rank, its exit code or signal, or its traceback's last line; the
other ranks are then stopped, so nothing waits on a lost peer.
"""
from __future__ import annotations

import collections
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any

from vllite_core.config import ConfigError, VlliteConfig
from vllite_core.core.sched_output import SchedulerOutput
from vllite_core.executor.base import Executor, StepHandle
from vllite_core.executor.errors import WorkerDiedError
from vllite_core.executor.wrapper import RankInfo
from vllite_core.utils import describe_exit
from vllite_core.worker.model_runner import ModelRunnerOutput

logger = logging.getLogger("vllite.executor")

WORKER_MODULE = "vllite_core.executor.mp_worker"  # each rank's process runs `python -m WORKER_MODULE FD`


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def exit_description(code: int | None) -> str:
    return "it closed its connection" if code is None else f"it ended ({describe_exit(code)})"


def _tee_stderr(proc: subprocess.Popen, rank: int) -> collections.deque[str]:
    """Copy a worker's stderr to ours as it comes, keeping its last lines for the error if it dies."""
    tail: collections.deque[str] = collections.deque(maxlen=20)

    def pump() -> None:
        assert proc.stderr is not None
        for raw in iter(proc.stderr.readline, b""):
            line = raw.decode(errors="replace")
            tail.append(line)
            try:
                sys.stderr.write(line)
            except (OSError, ValueError):  # our stderr closed (shutting down)
                pass

    threading.Thread(target=pump, name=f"vllite-worker-{rank}-stderr", daemon=True).start()
    return tail


def _stop(procs: list[subprocess.Popen], conns: list[Connection]) -> None:
    for c in conns:
        try:
            c.close()
        except OSError:
            pass
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + 5
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class MultiprocExecutor(Executor):
    backend = "mp"

    def __init__(self, config: VlliteConfig, platform: Any) -> None:
        super().__init__(config, platform)
        world = config.parallel_config.world_size
        self.node = socket.gethostname()
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        self.dead: WorkerDiedError | None = None
        self.pending: collections.deque[_PendingStep] = collections.deque()  # steps sent, replies not read
        self.stderr_tails: list[collections.deque[str]] = []  # each worker's last stderr lines
        env = dict(os.environ)
        # The parent's sys.path, so the workers import the same vllite (a checkout, a test's tmp plugin).
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        env["VLLITE_WORKER_LOG_LEVEL"] = str(logging.getLogger("vllite").getEffectiveLevel())
        for rank in range(world):
            mine, theirs = socket.socketpair()
            proc = subprocess.Popen([sys.executable, "-m", WORKER_MODULE, str(theirs.fileno())],
                                    pass_fds=[theirs.fileno()], env=env, stderr=subprocess.PIPE)
            theirs.close()
            self.stderr_tails.append(_tee_stderr(proc, rank))
            self.procs.append(proc)
            self.conns.append(Connection(mine.detach()))
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns)
        init_method = f"tcp://127.0.0.1:{free_port()}"
        infos = [RankInfo(r, world, r, world, init_method) for r in range(world)]
        self._send_each("init_worker", [(config, platform, info) for info in infos])
        self._collect()
        self.layout = {"backend": "mp", "ranks": world, "nodes": 1,
                       "processes": [f"rank {r}: pid {p.pid} on {self.node}" for r, p in enumerate(self.procs)],
                       "devices": [str(platform.device(r)) for r in range(world)],
                       "dist_backend": platform.dist_backend,
                       "tensor_parallel_size": config.parallel_config.tensor_parallel_size,
                       "pipeline_parallel_size": config.parallel_config.pipeline_parallel_size}
        logger.info("mp executor: %d worker processes (%s), %s collectives", world,
                    ", ".join(str(p.pid) for p in self.procs), platform.dist_backend)

    # ---- RPC ------------------------------------------------------------------------------------------
    def _send_each(self, method: str, per_rank_args: list[tuple]) -> None:
        for rank, (conn, args) in enumerate(zip(self.conns, per_rank_args)):
            self._send(rank, conn, pickle.dumps((method, args)))

    def _send(self, rank: int, conn: Connection, payload: bytes) -> None:
        try:
            conn.send_bytes(payload)
        except (BrokenPipeError, ConnectionResetError, OSError):
            self._fail(rank, self._exit_cause(rank))

    def _send_all(self, method: str, args: tuple) -> None:
        if self.dead is not None:
            raise self.dead
        payload = pickle.dumps((method, args))
        for rank, conn in enumerate(self.conns):
            self._send(rank, conn, payload)

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        while self.pending:  # each worker answers in order: the steps in flight come first
            self._collect_step()
        self._send_all(method, args)
        return self._collect()

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(so).result()

    def execute_model_async(self, so: SchedulerOutput) -> StepHandle:
        self._send_all("execute_model", (so,))
        step = _PendingStep(self)
        self.pending.append(step)
        return step

    def _collect_step(self) -> None:
        """Read every rank's reply to the oldest step in flight."""
        step = self.pending[0]
        step.output = self._collect()[self.output_rank]
        step.done = True
        self.pending.popleft()

    def _collect(self) -> list[Any]:
        results: dict[int, Any] = {}
        pending = {conn: rank for rank, conn in enumerate(self.conns)}
        while pending:
            for conn in wait(list(pending)):
                rank = pending.pop(conn)
                try:
                    kind, value = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    self._fail(rank, self._exit_cause(rank))
                if kind == "error":
                    self._raise_remote(rank, *value)
                results[rank] = value
        return [results[r] for r in range(len(self.conns))]

    def _raise_remote(self, rank: int, summary: str, details: str, exc: BaseException | None) -> None:
        """A worker raised: a bad configuration comes back as the same ConfigError (naming the rank),
        anything else as WorkerDiedError; either way the workers are stopped."""
        if isinstance(exc, ConfigError):
            self.dead = WorkerDiedError(rank, self.node, summary)
            self.shutdown()
            raise type(exc)(f"{exc} (worker rank {rank})") from None
        self._fail(rank, summary, details)

    def _exit_cause(self, rank: int) -> str:
        proc = self.procs[rank]
        try:
            code = proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            code = None
        last = next((ln for ln in reversed(self.stderr_tails[rank]) if ln.strip()), None)
        return (f"the worker process (pid {proc.pid}) died: {exit_description(code)}"
                + (f"; its last error line: {last.strip()}" if last else ""))

    def _fail(self, rank: int, cause: str, details: str | None = None) -> None:
        self.dead = WorkerDiedError(rank, self.node, cause)
        if details:
            logger.error("worker rank %d failed:\n%s", rank, details)
        self.shutdown()
        raise self.dead

    def shutdown(self) -> None:
        if self._finalizer.alive:
            for conn in self.conns:
                try:
                    conn.send_bytes(pickle.dumps(("shutdown", ())))
                except OSError:
                    pass
            self._finalizer()


class _PendingStep:
    """A step the workers were sent; its replies are read in the order the steps went out."""

    def __init__(self, executor: MultiprocExecutor) -> None:
        self.executor = executor
        self.output: ModelRunnerOutput | None = None
        self.done = False

    def result(self) -> ModelRunnerOutput:
        while not self.done:
            self.executor._collect_step()
        assert self.output is not None
        return self.output
