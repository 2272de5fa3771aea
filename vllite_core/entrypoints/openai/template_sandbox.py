"""Chat templates rendered in a pool of killable processes under a time, memory and output budget.

Every template the server renders (its own and, with --trust-request-chat-template, a request's)
goes through ``TemplateSandbox.render``: a worker process (template_worker.py) renders it; past
``timeout_s`` of rendering the worker is killed and replaced, over its memory or output budget it
answers an error; each case is a 400 naming ``chat_template``. The event loop and the engine's
prep thread never run template code, so one template cannot hang, starve or bloat the server.
Each pool thread owns one worker and blocks on it; the event loop only awaits the thread.
"""
from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from vllite_core.entrypoints.openai.errors import APIError, bad_request
from vllite_core.entrypoints.openai.template_worker import wall_budget

logger = logging.getLogger("vllite.server")

PATH_ENV = "VLLITE_TEMPLATE_WORKER_PATH"
_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "template_worker.py")
STARTUP_TIMEOUT_S = 60.0  # a worker's own start-up (importing the renderer); not the render budget
BACKSTOP_S = 5.0  # past its budget the worker answers itself; past this too, the parent kills it


@dataclass(frozen=True)
class TemplateLimits:
    """The budget of one render (flags: --chat-template-*; docs/serving.md)."""
    timeout_s: float = 5.0  # CPU seconds of rendering (whole seconds; queueing for a worker is not counted)
    max_output_chars: int = 16 << 20
    memory_bytes: int = 512 << 20  # address space a worker may grow by
    workers: int = 2


@dataclass(frozen=True)
class RenderJob:
    """What a worker renders: the template text already resolved (``tokenizer.get_chat_template``)
    and everything it may see, as JSON."""
    template: str
    conversation: list[dict[str, Any]]
    add_generation_prompt: bool
    continue_final_message: bool
    kwargs: dict[str, Any] = field(default_factory=dict)  # special tokens, then the request's kwargs
    tools: list[dict[str, Any]] | None = None
    request_template: bool = False  # the request sent this template: errors name ``chat_template``

    def message(self) -> bytes:
        return (json.dumps({"template": self.template, "conversation": self.conversation,
                            "add_generation_prompt": self.add_generation_prompt,
                            "continue_final_message": self.continue_final_message, "kwargs": self.kwargs,
                            "tools": self.tools}, ensure_ascii=False)).encode()


def render_job(tokenizer: Any, conversation: list[dict[str, Any]], add_generation_prompt: bool,
               continue_final_message: bool, chat_template: str | None, template_kwargs: dict[str, Any] | None,
               request_template: bool) -> RenderJob:
    """The job ``tokenizer.apply_chat_template(conversation, tokenize=False, ...)`` would render:
    the same template choice and the tokenizer's special tokens as variables (cheap: no rendering)."""
    kwargs = dict(template_kwargs or {})
    tools = kwargs.pop("tools", None)
    try:
        template = tokenizer.get_chat_template(chat_template, tools)
    except ValueError as e:  # no template at all
        raise bad_request(f"the chat template could not render these messages: {e}", "messages") from None
    special = {k: [str(t) for t in v] if isinstance(v, (list, tuple)) else str(v)
               for k, v in tokenizer.special_tokens_map.items()}  # what apply_chat_template passes
    convo = [{k: v for k, v in m.items() if v is not None} for m in conversation]
    try:
        json.dumps(kwargs)
    except (TypeError, ValueError):
        raise bad_request("chat_template_kwargs must be JSON values", "chat_template_kwargs") from None
    return RenderJob(template, convo, add_generation_prompt, continue_final_message, {**special, **kwargs}, tools,
                     request_template)


class _Worker:
    """One renderer process (template_worker.py, by file path): it forks a child per job."""

    def __init__(self, limits: TemplateLimits) -> None:
        self.proc = subprocess.Popen(
            # -I: no script directory on sys.path (its modules must not shadow anything); this process's
            # path comes after the worker's own, for jinja2 and transformers wherever they are installed.
            [sys.executable, "-I", _WORKER, str(limits.timeout_s), str(limits.max_output_chars),
             str(limits.memory_bytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env={**os.environ, PATH_ENV: os.pathsep.join(p for p in sys.path if p)})
        self.ready = False
        self.buf = b""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(data + b"\n")
        self.proc.stdin.flush()

    def receive(self, deadline: float, max_bytes: int) -> bytes | None:
        """One line from the worker, or None past ``deadline`` / over ``max_bytes`` / when it died."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or len(self.buf) > max_bytes or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


class TemplateSandbox:
    """A pool of ``limits.workers`` rendering processes; ``render`` is awaited from the event loop."""

    def __init__(self, limits: TemplateLimits | None = None) -> None:
        self.limits = limits or TemplateLimits()
        self._pool = ThreadPoolExecutor(max_workers=self.limits.workers, thread_name_prefix="vllite-template")
        self._local = threading.local()
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        self.killed = 0  # workers ended for running past the budget (/metrics)
        self.last_progress = time.monotonic()  # a render finished (health: the pool is not wedged)
        self.busy = 0
        self._closed = False
        # Dropped without close() (an app built in a test): its workers still end.
        self._finalizer = weakref.finalize(self, _end_workers, self._workers, self._pool)

    async def render(self, job: RenderJob) -> str:
        import asyncio

        return await asyncio.wrap_future(self._pool.submit(self._render, job))

    def start(self) -> None:
        """Start the workers now (they take a second or two to import), so the first chat is not slower."""
        for _ in range(self.limits.workers):
            self._pool.submit(self._worker)

    def _new_worker(self) -> _Worker:
        w = _Worker(self.limits)
        with self._lock:
            self._workers.append(w)
        return w

    def _drop(self, w: _Worker) -> None:
        try:
            w.kill()
        except (OSError, ValueError):
            pass
        with self._lock:
            if w in self._workers:
                self._workers.remove(w)
        self._local.worker = None

    def _worker(self) -> _Worker:
        w: _Worker | None = getattr(self._local, "worker", None)
        if w is not None and not w.alive():
            self._drop(w)
            w = None
        if w is None:
            w = self._local.worker = self._new_worker()
        if not w.ready:
            line = w.receive(time.monotonic() + STARTUP_TIMEOUT_S, 1 << 10)
            if line is None or json.loads(line) != {"ready": True}:
                self._drop(w)
                raise APIError(503, "the chat template renderer did not start", code="template_renderer_failed")
            w.ready = True
        return w

    def _render(self, job: RenderJob) -> str:
        if self._closed:
            raise APIError(503, "the server is shutting down", code="server_shutting_down")
        w = self._worker()
        self.busy += 1
        try:
            return self._exchange(w, job)
        finally:
            self.busy -= 1
            self.last_progress = time.monotonic()

    def _exchange(self, w: _Worker, job: RenderJob) -> str:
        lim = self.limits
        try:
            w.send(job.message())
        except (BrokenPipeError, OSError):
            self._drop(w)
            raise APIError(503, "the chat template renderer stopped", code="template_renderer_failed") from None
        line = w.receive(time.monotonic() + wall_budget(lim.timeout_s) + BACKSTOP_S, 6 * lim.max_output_chars + 4096)
        if line is None:  # the worker itself did not answer in time: it is replaced
            self._drop(w)
            self.killed += 1
            self._replace()
            raise bad_request(f"the chat template took over {lim.timeout_s:g} s to render and was stopped",
                              "chat_template", "chat_template_over_budget")
        reply = json.loads(line)
        if "text" in reply:
            return reply["text"]
        kind, msg = reply["error"], reply["message"]
        if kind in ("timeout", "memory", "size"):  # the worker killed its render child
            self.killed += 1
            raise bad_request(f"{msg}; it was stopped", "chat_template", "chat_template_over_budget")
        param = "chat_template" if job.request_template else None
        if kind == "unsafe":
            raise bad_request(f"the chat template is not allowed: {msg}", param, "unsafe_chat_template")
        if kind == "syntax" and job.request_template:
            raise bad_request(f"the chat template does not compile: {msg}", "chat_template")
        raise bad_request(f"the chat template could not render these messages: {msg}", "messages")

    def _replace(self) -> None:
        """Start this thread's next worker now, so its start-up overlaps the wait for the next job."""
        if not self._closed:
            self._local.worker = self._new_worker()

    def close(self) -> None:
        self._closed = True
        self._finalizer()


def _end_workers(workers: list[_Worker], pool: ThreadPoolExecutor) -> None:
    pool.shutdown(wait=False, cancel_futures=True)
    for w in list(workers):
        try:
            w.kill()
        except (OSError, ValueError):
            pass
    workers.clear()
