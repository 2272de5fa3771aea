"""`vllite serve --headless`: a node that runs data-parallel engine cores and no API server.

It starts one engine-core process per local rank (``--data-parallel-start-rank`` on, as many as
``--data-parallel-size-local``), each connecting to the head node's front end (dp_layout.py), and keeps
them running: a core that exits is started again, so a restarted API server, or a core that died, gets
its rank back. A core that stopped because its API server went away (exit 0) starts again at once; one
that crashed counts against --engine-restart-max within --engine-restart-window (after the backoff
engine/restart.py gives), past which the node stops its cores and exits 1.
"""
from __future__ import annotations

import argparse
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
from typing import Any

from vllite_core.engine.dp_layout import DataParallelLayout
from vllite_core.engine.restart import RestartPolicy
from vllite_core.utils import describe_exit

logger = logging.getLogger("vllite.headless")

_STOP_S = 5.0  # how long a core may take to exit on SIGTERM before it is killed
_AGAIN_S = 1.0  # before a core that stopped cleanly (its API server went away) starts again


class HeadlessNode:
    """This node's engine-core processes, by data-parallel rank, started again when they exit."""

    def __init__(self, config: Any, layout: DataParallelLayout, policy: RestartPolicy) -> None:
        self.config, self.layout, self.policy = config, layout, policy
        self.procs: dict[int, Any] = {}  # rank -> multiprocessing.Process
        self.stopping = threading.Event()
        self._stop_r, self._stop_w = os.pipe()

    def _spawn(self, rank: int) -> None:
        from vllite_core.engine.core_proc import run_engine_core

        proc = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, args=(self.config, rank, None, self.layout.front_end),
            name=f"VlliteEngineCore_{rank}", daemon=False)
        proc.start()
        self.procs[rank] = proc

    def start(self) -> None:
        for rank in self.layout.local_ranks:
            self._spawn(rank)

    def stop(self) -> None:
        self.stopping.set()
        os.write(self._stop_w, b"x")

    def supervise(self) -> int:
        """Until ``stop`` (0) or a core out of restarts (1)."""
        while not self.stopping.is_set():
            sentinels = {p.sentinel: rank for rank, p in self.procs.items()}
            ready = multiprocessing.connection.wait([*sentinels, self._stop_r])
            for s in ready:
                if s == self._stop_r or self.stopping.is_set():
                    break
                rank = sentinels[s]
                proc = self.procs[rank]
                proc.join(5)
                print(f"vllite: headless node: DP rank {rank} pid {proc.pid} exited ({describe_exit(proc.exitcode)})",
                      flush=True)
                delay = _AGAIN_S if proc.exitcode == 0 else self.policy.next_delay()
                if delay is None:
                    print(f"vllite serve --headless: DP rank {rank} died ({describe_exit(proc.exitcode)}) and may "
                          f"not start again ({self.policy.max_restarts} restarts in {self.policy.window_s:g} s)",
                          flush=True)
                    self.close()
                    return 1
                if proc.exitcode != 0:
                    self.policy.record()
                if self.stopping.wait(delay):
                    break
                self._spawn(rank)
                print(f"vllite: headless node: DP rank {rank} pid {self.procs[rank].pid} started again", flush=True)
        self.close()
        return 0

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs.values():
            proc.join(_STOP_S)
            if proc.is_alive():
                proc.kill()
                proc.join(2)


def run_headless(ns: argparse.Namespace, layout: DataParallelLayout, policy: RestartPolicy) -> int:
    from vllite_core.entrypoints.engine_args_cli import engine_args_from_namespace

    logging.basicConfig(level=os.environ.get("VLLITE_LOG_LEVEL", "INFO"),
                        format="%(levelname)s %(name)s: %(message)s")
    node = HeadlessNode(engine_args_from_namespace(ns).create_config(), layout, policy)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: node.stop())
    node.start()
    ranks = ", ".join(f"DP rank {rank} pid {node.procs[rank].pid}" for rank in layout.local_ranks)
    print(f"vllite: headless node: {ranks} (of {layout.size}) connect to {layout.front_end}; no API server",
          flush=True)
    return node.supervise()
