"""Main of one worker process of the ``mp`` executor: ``python -m vllite_core.executor.mp_worker FD``.

FD is this process's end of a socket pair the executor made: requests come in as pickled
``(method, args)``, each answered with ``("ok", result)`` or ``("error", (summary, traceback,
exception))``. When the engine process goes away the socket closes and this process exits; on Linux
it is also killed with its parent.
"""
from __future__ import annotations

import pickle
import sys
import traceback
from multiprocessing.connection import Connection


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            import signal

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def serve(conn: Connection) -> None:
    from vllite_core.executor.wrapper import WorkerWrapper

    wrapper = WorkerWrapper()
    while True:
        try:
            method, args = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the engine is gone
        if method == "shutdown":
            conn.send_bytes(pickle.dumps(("ok", None)))
            return
        try:
            reply = ("ok", wrapper.call(method, *args))
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the engine, named
            reply = ("error", (f"{type(e).__name__}: {e}", traceback.format_exc(), _picklable(e)))
        try:
            # Plain pickle: tensors travel by value. Connection.send's pickler would pass a tensor (a pooled
            # embedding) as a shared-memory handle the engine cannot open (torch's reductions).
            conn.send_bytes(pickle.dumps(reply))
        except (BrokenPipeError, OSError):
            return


def _picklable(e: BaseException) -> BaseException | None:
    """The exception itself when it survives pickling (a ConfigError is re-raised as one), else None."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001
        return None


def main() -> None:
    _die_with_parent()
    import logging
    import os

    # The engine process's level for vllite's loggers; lines say which worker wrote them.
    logging.basicConfig(format=f"%(levelname)s %(name)s (worker pid {os.getpid()}): %(message)s")
    logging.getLogger("vllite").setLevel(int(os.environ.get("VLLITE_WORKER_LOG_LEVEL", logging.WARNING)))
    conn = Connection(int(sys.argv[1]))
    try:
        serve(conn)
    finally:
        from vllite_core.distributed.parallel_state import destroy_tensor_parallel

        try:
            destroy_tensor_parallel()
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass


if __name__ == "__main__":
    main()
