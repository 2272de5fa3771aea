"""Large request bodies are validated in a helper process, not on the event loop.

Measured (scripts in docs/serving.md, "Reliability limits"): a 4 MiB completion body of token ids
takes ~0.3 s of CPU in pydantic-core's ``model_validate_json``, and pydantic-core holds the GIL
the whole time, so a thread does not help (the loop's worst gap equals the parse time either way);
in a process the loop only unpickles the result. Small bodies (the usual case) parse on the loop:
a process round trip costs more than they do. The helper is started on the first large body.

The helper is a small program of its own (``python -m vllite_core.entrypoints.openai.body_parser``),
not a multiprocessing child: a spawned child first imports the parent's ``__main__`` (the server's
CLI, so torch: ~240 MB and seconds of start-up). This module and the request models import
pydantic only (tests/server/test_body_parser.py checks that torch stays out of the helper). It reads
``(model class, body)`` pickles on its stdin and answers each on its stdout, one at a time.
"""
from __future__ import annotations

import asyncio
import os
import pickle
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any, TypeVar

from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)

DEFAULT_OFFLOAD_BYTES = 1 << 20  # ~80 ms of validation on the loop at most (one CPU)
_STOP_S = 2.0  # how long close() waits for the helper to exit before it kills it


class BodyParserDied(RuntimeError):
    """The helper process died (killed, out of memory) during a parse; a fresh one starts next time."""


def validate(model: type[M], body: bytes) -> tuple[M | None, dict[str, Any] | None]:
    """(the model, None) or (None, its first validation error as plain data)."""
    try:
        return model.model_validate_json(body), None
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        return None, {k: err[k] for k in ("type", "loc", "msg") if k in err}


class _Helper:
    """One helper process and its pipes (used by one thread at a time)."""

    def __init__(self) -> None:
        env = dict(os.environ)  # the parent's import path, so the models it names import there too
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        self.proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env)

    def ask(self, model: type[M], body: bytes) -> tuple[M | None, dict[str, Any] | None]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            pickle.dump((model, body), self.proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            self.proc.stdin.flush()
            ok, value = pickle.load(self.proc.stdout)
        except (OSError, EOFError, pickle.UnpicklingError) as e:
            raise BodyParserDied(f"the body parser process stopped ({e!r})") from None
        if not ok:
            raise value  # what validation raised besides a ValidationError
        return value

    def close(self) -> None:
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()  # it exits at the end of its input
            except OSError:
                pass
        try:
            self.proc.wait(_STOP_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class BodyParser:
    """``parse(body, model)``: on the loop below ``offload_bytes``, else in one helper process,
    started again if it dies (that parse raises ``BodyParserDied``)."""

    def __init__(self, offload_bytes: int = DEFAULT_OFFLOAD_BYTES) -> None:
        self.offload_bytes = offload_bytes
        self._helper: _Helper | None = None
        self._lock = threading.Lock()
        # One thread talks to the helper: parses queue in order, the event loop never waits on the pipe.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllite-body-parser")

    def _ask(self, model: type[M], body: bytes) -> tuple[M | None, dict[str, Any] | None]:
        with self._lock:
            if self._helper is None:
                self._helper = _Helper()
            helper = self._helper
        try:
            return helper.ask(model, body)
        except BodyParserDied:
            with self._lock:
                if self._helper is helper:
                    self._helper = None
            helper.close()
            raise

    async def parse(self, body: bytes, model: type[M]) -> tuple[M | None, dict[str, Any] | None]:
        """(the model, None), or (None, the first validation error: type, loc, msg)."""
        if not self.offload_bytes or len(body) < self.offload_bytes:
            return validate(model, body)
        return await asyncio.wrap_future(self._thread.submit(self._ask, model, body))

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            helper, self._helper = self._helper, None
        if helper is not None:
            helper.close()


def _serve(requests: IO[bytes], answers: IO[bytes]) -> None:
    """The helper's loop: one (ok, value) answer per (model, body) request, until its input ends."""
    while True:
        try:
            model, body = pickle.load(requests)
        except EOFError:
            return
        try:
            answer: tuple[bool, Any] = (True, validate(model, body))
        except Exception as e:  # noqa: BLE001 - raised again in the server, as on the loop
            answer = (False, e)
        pickle.dump(answer, answers, protocol=pickle.HIGHEST_PROTOCOL)
        answers.flush()


if __name__ == "__main__":
    _answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a stray print goes to stderr, never into the answers
    _serve(sys.stdin.buffer, _answers)
