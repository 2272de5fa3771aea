"""Large request bodies are validated in a helper process, not on the event loop.

Measured (scripts in docs/serving.md, "Reliability limits"): a 4 MiB completion body of token ids
takes ~0.3 s of CPU in pydantic-core's ``model_validate_json``, and pydantic-core holds the GIL
the whole time, so a thread does not help (the loop's worst gap equals the parse time either way);
in a process the loop only unpickles the result. Small bodies (the usual case) parse on the loop:
a process round trip costs more than they do. The helper is started on the first large body.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)

DEFAULT_OFFLOAD_BYTES = 1 << 20  # ~80 ms of validation on the loop at most (one CPU)


def validate(model: type[M], body: bytes) -> tuple[M | None, dict[str, Any] | None]:
    """In the helper: (the model, None) or (None, its first validation error as plain data)."""
    try:
        return model.model_validate_json(body), None
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        return None, {k: err[k] for k in ("type", "loc", "msg") if k in err}


class BodyParser:
    """``parse(body, model)``: on the loop below ``offload_bytes``, else in one helper process
    (spawned, so nothing of the server's threads is forked), started again if it dies."""

    def __init__(self, offload_bytes: int = DEFAULT_OFFLOAD_BYTES) -> None:
        self.offload_bytes = offload_bytes
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def _get_pool(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
            return self._pool

    async def parse(self, body: bytes, model: type[M]) -> tuple[M | None, dict[str, Any] | None]:
        """(the model, None), or (None, the first validation error: type, loc, msg)."""
        if not self.offload_bytes or len(body) < self.offload_bytes:
            return validate(model, body)
        pool = self._get_pool()
        try:
            return await asyncio.wrap_future(pool.submit(validate, model, body))
        except BrokenProcessPool:  # the helper died (killed, out of memory): a fresh one next time
            with self._lock:
                if self._pool is pool:
                    self._pool = None
            pool.shutdown(wait=False, cancel_futures=True)
            raise

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
