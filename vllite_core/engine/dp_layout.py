"""Data parallelism over nodes, as vLLM spells it: which ranks run on this node, and the ZMQ link
between the head node's API server (the front end) and the engine cores of the other nodes.

The head node (``vllite serve --data-parallel-size N --data-parallel-size-local L
--data-parallel-address HOST [--data-parallel-rpc-port P]``) runs ranks ``0 .. L-1`` in engine-core
processes of its own and binds one ROUTER socket on ``tcp://HOST:P``. A ``--headless`` node
(``--data-parallel-start-rank S --data-parallel-size-local L2``, no API server) starts ranks
``S .. S+L2-1``; each of its engine cores connects one DEALER socket to that address, with a routing id
of its own, and sends and receives its messages on it (the same msgpack messages a local core sends
over its ipc sockets). ZMQ heartbeats on both sides close a link whose peer stopped answering, so a
node that vanishes is seen like a process that exited.
"""
from __future__ import annotations

import logging
import os
import threading
import uuid
from dataclasses import dataclass
from typing import Callable

import zmq

from vllite_core.errors import ConfigError

logger = logging.getLogger("vllite.data_parallel")

DEFAULT_RPC_PORT = 29550  # vLLM's default --data-parallel-rpc-port
HEARTBEAT_IVL_MS = 1000  # each side pings the other this often (answered by ZMQ's I/O thread, never blocked by a step)
HEARTBEAT_TIMEOUT_MS = 10_000  # a link with no traffic for this long is closed: its peer is gone
HEAD_GONE_GRACE_S = 10.0  # a remote core whose front end is gone stops; past this it exits at once


@dataclass(frozen=True)
class DataParallelLayout:
    """The data-parallel ranks of the whole deployment and the ones this node runs."""

    size: int = 1  # --data-parallel-size: engine cores in all
    size_local: int = 1  # --data-parallel-size-local: engine cores on this node
    start_rank: int = 0  # --data-parallel-start-rank: this node's first rank (0 on the head node)
    address: str | None = None  # --data-parallel-address: where the head node's front end listens
    rpc_port: int = DEFAULT_RPC_PORT  # --data-parallel-rpc-port
    headless: bool = False  # --headless: this node runs engine cores only
    backend: str = "mp"  # --data-parallel-backend: who starts the other nodes' ranks (headless nodes, or Ray)

    @property
    def local_ranks(self) -> range:
        return range(self.start_rank, self.start_rank + self.size_local)

    @property
    def spans_nodes(self) -> bool:
        """Some ranks run on other nodes (their cores connect to the front end)."""
        return self.headless or self.size_local < self.size

    @property
    def front_end(self) -> str:
        host = self.address or "127.0.0.1"
        return f"tcp://[{host}]:{self.rpc_port}" if ":" in host else f"tcp://{host}:{self.rpc_port}"


def data_parallel_layout(size: int, size_local: int | None = None, start_rank: int = 0,
                         address: str | None = None, rpc_port: int = DEFAULT_RPC_PORT,
                         headless: bool = False, backend: str = "mp") -> DataParallelLayout:
    """The layout the options describe; a combination that cannot work is a ConfigError naming the flag.
    ``size_local`` defaults to the ranks from ``start_rank`` to the last."""
    if size < 1:
        raise ConfigError(f"--data-parallel-size: must be at least 1, got {size}")
    if start_rank < 0 or start_rank >= size:
        raise ConfigError(f"--data-parallel-start-rank: must be in [0, {size}) (--data-parallel-size {size}), "
                          f"got {start_rank}")
    local = size - start_rank if size_local is None else size_local
    if local < 0 or local > size:
        raise ConfigError(f"--data-parallel-size-local: must be between 0 and --data-parallel-size ({size}), "
                          f"got {local}")
    if start_rank + local > size:
        raise ConfigError(f"--data-parallel-start-rank {start_rank} + --data-parallel-size-local {local} runs ranks "
                          f"past --data-parallel-size {size}")
    if not 0 < rpc_port < 65536:
        raise ConfigError(f"--data-parallel-rpc-port: must be a TCP port (1-65535), got {rpc_port}")
    if start_rank and not headless:
        raise ConfigError("--data-parallel-start-rank: only a --headless node starts past rank 0 (the API server's "
                          "node runs ranks 0 .. --data-parallel-size-local - 1)")
    if start_rank and address is None:
        raise ConfigError("--data-parallel-start-rank needs --data-parallel-address (the head node's address, where "
                          "this node's engine cores connect)")
    if backend not in ("mp", "ray"):
        raise ConfigError(f"--data-parallel-backend: 'mp' or 'ray', got {backend!r}")
    if backend == "ray" and headless:
        raise ConfigError("--data-parallel-backend ray: the API server's node places every other rank on the Ray "
                          "cluster itself; no --headless node is started")
    if headless and address is None:
        raise ConfigError("--headless needs --data-parallel-address (the head node's address)")
    if headless and local < 1:
        raise ConfigError("--headless: --data-parallel-size-local must be at least 1 (the engine cores this node runs)")
    if local < size and address is None and backend != "ray":
        raise ConfigError(f"--data-parallel-size-local {local} < --data-parallel-size {size} needs "
                          "--data-parallel-address (where the other nodes' engine cores connect)")
    return DataParallelLayout(size, local, start_rank, address, rpc_port, headless, backend)


def _heartbeats(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)


def bind_front_end(ctx: zmq.Context, layout: DataParallelLayout) -> tuple[zmq.Socket, zmq.Socket]:
    """The head's ROUTER for the remote ranks, bound, and a monitor socket that reports its links closing
    (``EVENT_DISCONNECTED``). A send to a core whose link is gone raises EHOSTUNREACH (ROUTER_MANDATORY)."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.SNDHWM, 0)  # no limit: a send fails (never blocks) only without the peer
    _heartbeats(sock)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        sock.bind(layout.front_end)
    except zmq.ZMQError as e:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)
        raise ConfigError(f"--data-parallel-rpc-port: cannot listen on {layout.front_end} "
                          f"(--data-parallel-address {layout.address}): {e}") from None
    return sock, monitor


def connect_to_front_end(ctx: zmq.Context, address: str, engine_index: int,
                         on_gone: Callable[[], None]) -> zmq.Socket:
    """A remote core's one socket to the head's front end (it sends and receives on it). ``on_gone`` runs
    (on a thread of its own) once the link, after it was up, closes: the API server stopped or its
    node vanished."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"dp{engine_index}-{os.getpid()}-{uuid.uuid4().hex[:8]}".encode())
    sock.setsockopt(zmq.LINGER, 5000)
    sock.setsockopt(zmq.SNDHWM, 0)
    _heartbeats(sock)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)

    def watch() -> None:
        try:
            monitor.recv_multipart()
        except zmq.ZMQError:  # the context ended: the core stopped first
            monitor.close(0)
            return
        monitor.close(0)  # before the core's own stop, which ends the context (waiting for every socket)
        logger.warning("engine core %d: the API server at %s is gone; the engine core stops", engine_index,
                       address)
        on_gone()

    threading.Thread(target=watch, name="vllite-front-end-watch", daemon=True).start()
    sock.connect(address)
    return sock


def stop_when_front_end_gone(stop: threading.Event) -> Callable[[], None]:
    """``on_gone`` for a remote core: ask its loop to stop (it does between steps once idle), and end the
    process after HEAD_GONE_GRACE_S if it has not (a busy core blocks sending to the missing peer)."""
    def gone() -> None:
        stop.set()
        threading.Event().wait(HEAD_GONE_GRACE_S)
        logger.error("the engine core did not stop in %g s after its API server went away: exiting", HEAD_GONE_GRACE_S)
        os._exit(1)
    return gone
