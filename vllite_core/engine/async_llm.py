"""AsyncLLM: the engine behind an asyncio server.

The synchronous LLMEngine runs in one dedicated thread, the *engine loop*: it
owns the engine, drains an inbox of adds and aborts between steps, sleeps on a
condition when there is nothing to do, and hands each step's outputs to the
asyncio loop with one ``loop.call_soon_threadsafe``. A thread, not a process:
torch releases the GIL inside its kernels, so the API's Python work (HTTP, JSON,
tokenizing) overlaps the model's compute, with no IPC and no second copy of the
weights. The price is GIL contention; ``LoopStats`` measures where the loop's
time goes so that it can be checked (docs/serving.md has the numbers).

Requests are tokenized and validated before they reach the loop (``LLMEngine.prepare_request``),
so a bad request fails at once (before anything is streamed) and the loop never waits on API
work; the loop queues the prepared request as it is (``add_prepared_request``), without
validating it again. ``add_request_async`` (what ``generate()`` and the server use) prepares on
the *prep thread*, one worker thread with a tokenizer copy of its own (``run_prep``): tokenizing
a prompt of a few MB takes seconds, which on the asyncio loop would stall every other request,
``/health`` included. One worker, so its tokenizer is never used by two threads at once and
requests are prepared (and queued) in the order they came. The sync ``add_request`` prepares on
the asyncio side with that side's copy, as before. The loop
asks the engine for cumulative outputs; the asyncio side turns them into what the
caller sees with the request's DeltaCursor (engine/delta.py, the same code as the
sync engine's ``step(delta=True)``), which holds back the tail of the text that
could still turn out to be the start of a stop string, so streamed deltas always
concatenate to the final text.

Faults (docs/serving.md): a request that fails alone (``finish_reason="error"``
from the engine) makes its stream raise ``RequestFailedError`` naming the cause,
and its other completions (``n > 1``) are aborted; the other requests go on. An
error in a step that belongs to no request stops the loop: ``dead`` is set, every
open stream raises ``EngineDeadError`` naming the cause, new requests are refused
with it, and the ``on_dead`` callbacks run (the server uses one to exit).

A dead engine-core process (``core.restartable``) is brought back instead, within the restart
budget (engine/restart.py, ``CoreRestarter``): its open streams fail with ``EngineDeadError`` as
above, ``restarting`` holds the cause (/health is 503) and the loop starts the core again after the
policy's backoff, then looks on each turn whether it serves yet (it never waits for the model load);
then the engine serves as before. Past the budget it is dead as above. With one core (or all dead)
``all_cores_restarting`` is set too: new requests are refused with it, and requests queued before the
death are recognised by ``_epoch`` and never reach the new core. With data-parallel cores
(``EngineCoreDeadError``) only the dead core's requests fail and only it starts again: the loop keeps
stepping the other cores, whose requests stream on, and new requests go to them meanwhile. Calls
(sleep mode, collective_rpc: engine/core_calls.py) wait until the restart ends: they need every core.
"""
from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, TypeVar

from vllite_core.core.stats import SchedulerStats
from vllite_core.engine.core_calls import CoreCall, CoreCalls
from vllite_core.engine.core_client import EngineCoreClient
from vllite_core.engine.heap_trim import HeapTrimmer
from vllite_core.engine.llm_engine import LLMEngine, PromptType
from vllite_core.engine.request_stream import FinishedRequest, RequestStream
from vllite_core.engine.restart import CoreRestarter, RestartPolicy
from vllite_core.errors import (
    ConfigError,
    EngineCoreDeadError,
    EngineDeadError,
    EngineSleepingError,
    InvalidRequestError,
    RequestFailedError,
)
from vllite_core.inputs import InputContext, ProcessedPrompt
from vllite_core.outputs import RequestOutput
from vllite_core.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from vllite_core.engine.dp_layout import DataParallelLayout

logger = logging.getLogger("vllite.async_llm")

_BACKOFF_S = 0.005  # wait when the scheduler had nothing it could run (avoids a hot spin)


T = TypeVar("T")

__all__ = ["AsyncLLM", "EngineDeadError", "FinishedRequest", "RequestFailedError", "RequestStream"]


@dataclass
class LoopStats:
    """Where the engine loop's time went. ``step_s`` is model + scheduling (LLMEngine.step);
    ``other_s`` is the loop's own work while busy (inbox, hand-off); ``idle_s`` is asleep."""

    steps: int = 0
    step_s: float = 0.0
    other_s: float = 0.0
    idle_s: float = 0.0
    trim_s: float = 0.0  # giving freed heap back to the OS (engine/heap_trim.py)
    thread_id: int | None = None  # native id of the engine loop thread


@dataclass
class _Add:
    """A request prepared (processed and validated) off the engine loop."""

    request_id: str
    processed: ProcessedPrompt
    params: SamplingParams
    max_tokens: int
    priority: int
    epoch: int = 0  # the engine core's life it was queued for (AsyncLLM._epoch)


@dataclass
class _Abort:
    request_id: str
    epoch: int = 0


class AsyncLLM:
    """``generate()`` streams RequestOutputs for one request; ``abort()`` ends one early.

    Call everything except ``close()`` from the asyncio loop the server runs on.
    """

    def __init__(self, engine: LLMEngine, restart: RestartPolicy | None = None) -> None:
        """``restart``: how often a dead engine-core process is started again (None: never)."""
        self.engine = engine
        # The engine's core, through its client (in this process or in engine-core processes): the loop
        # steps it through ``engine``; the numbers, the wake-ups and the layout come from it directly.
        self.core: EngineCoreClient = engine.core
        # The loop thread detokenizes with engine.tokenizer; this copy serves the asyncio side.
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        # Prompts are processed on this side, with this tokenizer (models that process their own
        # prompts, encoder-decoder and multimodal, too).
        ctx = engine.input_context
        self._ctx = InputContext(self.tokenizer, ctx.hf_config, ctx.model_path)
        self.input_context = self._ctx if engine.config.model_config.capabilities.processes_prompts else None
        # The prep thread's own copy: used only by functions run there (run_prep), one at a time.
        self.prep_tokenizer = copy.deepcopy(engine.tokenizer)
        self._prep_ctx = InputContext(self.prep_tokenizer, ctx.hf_config, ctx.model_path)
        self._prep = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllite-prep")
        self._reserved: set[str] = set()  # request ids being prepared on the prep thread
        self.max_model_len = engine.max_model_len
        self.loop_stats = LoopStats()
        # The core's numbers after the loop's latest turn, for readers on other threads (/metrics).
        self.snapshot: SchedulerStats = self.core.stats()
        self.observers: list[Callable[[FinishedRequest], None]] = []
        self.dead: BaseException | None = None
        self.restart_policy = restart if restart is not None and self.core.restartable else None
        self._restarter = CoreRestarter(engine, self.restart_policy)
        self.calls = CoreCalls(self, self._post)  # sleep mode, collective_rpc: run on the loop thread
        self._epoch = 0  # +1 at each core death: what was queued before never reaches the new core
        # Called on the asyncio loop, once, with the cause when the engine loop dies.
        self.on_dead: list[Callable[[BaseException], None]] = []
        self._streams: dict[str, RequestStream] = {}
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._cond = threading.Condition()
        self._inbox: list[_Add | _Abort | CoreCall] = []
        self._stopping = False
        self._ids = itertools.count()
        # An engine core in its own process (mp_client.py): wake the loop when it dies, so the open
        # requests fail at once even while the loop sleeps; a post wakes its wait for outputs.
        self._wake_pending = False
        self.core.on_failure.append(self._wake_loop)
        self._thread = threading.Thread(target=self._run, name="vllite-engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args: Any, data_parallel_size: int = 1, multiprocess: bool | None = None,
                         restart: RestartPolicy | None = None, dp: DataParallelLayout | None = None) -> "AsyncLLM":
        """The server's engine: its core(s) in their own processes unless ``multiprocess`` is False or
        VLLITE_ENABLE_V1_MULTIPROCESSING=0 (then in this process, on the engine-loop thread).
        ``data_parallel_size`` > 1 needs the engine-core processes; ``restart`` applies to them. ``dp``: data
        parallelism across nodes (its size is the data-parallel size)."""
        from vllite_core.engine.core_client import multiprocessing_enabled
        from vllite_core.engine.mp_client import MPClient

        if multiprocess is None:
            multiprocess = multiprocessing_enabled(default=True)
        if not multiprocess:
            if data_parallel_size != 1:
                raise ConfigError(f"data_parallel_size: {data_parallel_size} needs the engine cores in their own "
                                  "processes (VLLITE_ENABLE_V1_MULTIPROCESSING=1)")
            return cls(LLMEngine.from_engine_args(args))
        client = MPClient(args.create_config(), dp.size if dp is not None else data_parallel_size, dp, restart)
        try:
            return cls(LLMEngine(client.info.config, core=client), restart)
        except BaseException:
            client.shutdown()
            raise

    def layout(self) -> dict[str, Any]:
        """The process layout: this (API) process, and each engine core's process and data-parallel rank."""
        return self.core.layout()

    def parallel_layout(self) -> dict[str, Any]:
        """The executor's ranks, processes and devices (each engine core's, as its core reported them)."""
        return self.core.info.parallel_layout

    def engine_stats(self) -> list[SchedulerStats]:
        """Each data-parallel engine core's latest numbers (one record for a single core)."""
        return self.core.engine_stats()

    def num_kv_blocks(self) -> int:
        return self.core.num_kv_blocks()

    @property
    def restarting(self) -> BaseException | None:
        """While an engine core restarts: why it died (/health is 503)."""
        return self._restarter.cause

    @property
    def all_cores_restarting(self) -> BaseException | None:
        """While every engine core restarts (none can take a request): why; new requests are refused."""
        return self._restarter.cause if self._restarter.whole else None

    @property
    def num_restarts(self) -> int:
        """Engine-core restarts that brought it back."""
        return self._restarter.num_restarts

    def _wake_loop(self) -> None:
        with self._cond:
            self._cond.notify()

    # ---- asyncio side -------------------------------------------------------------------
    @property
    def policy(self) -> str:
        return self.engine.config.scheduler_config.policy

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def detokenize(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    async def run_prep(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the prep thread (CPU-heavy request work off the asyncio loop): what it
        raises is raised here. Only such functions may use ``prep_tokenizer``."""
        return await asyncio.wrap_future(self._prep.submit(fn, *args))

    def prepare(self, prompt: PromptType, params: SamplingParams,
                lora_request: Any = None) -> tuple[ProcessedPrompt, int]:
        """``LLMEngine.prepare_request`` with the prep thread's tokenizer: call it there (run_prep)."""
        return self.engine.prepare_request(prompt, params, self._prep_ctx, lora_request)

    def check_new(self, request_id: str, priority: int = 0) -> None:
        """What ``add_request`` checks before any work: engine alive and awake, id new, priority allowed."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine loop stopped: {self.dead!r}")
        if self.all_cores_restarting is not None:
            raise EngineDeadError(f"the engine core is restarting after it died: {self.all_cores_restarting}")
        if self.engine.sleeping or self.calls.draining:
            raise EngineSleepingError(f"request {request_id!r}")
        loop = asyncio.get_running_loop()
        if self._aloop is None:
            self._aloop = loop
        elif self._aloop is not loop:
            raise RuntimeError("AsyncLLM is bound to another event loop")
        if request_id in self._streams or request_id in self._reserved:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        if priority != 0 and self.policy != "priority":
            raise InvalidRequestError("priority", "priority needs the server started with --scheduling-policy "
                                      "priority")

    def add_prepared(self, request_id: str, processed: ProcessedPrompt, params: SamplingParams, max_tokens: int,
                     priority: int = 0) -> RequestStream:
        """Queue a request ``prepare`` accepted (checked again here: no await since)."""
        self.check_new(request_id, priority)
        stream = RequestStream(request_id, params, len(processed.prompt_token_ids))
        self._streams[request_id] = stream
        self._post(_Add(request_id, processed, params, max_tokens, priority, self._epoch))
        return stream

    def add_request(self, prompt: PromptType, params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int = 0) -> RequestStream:
        """Validate and queue a request, preparing it on the asyncio side (add_request_async does not);
        errors (bad prompt, too long, bad priority) raise here."""
        params = params or SamplingParams()
        request_id = request_id or f"req-{next(self._ids)}"
        self.check_new(request_id, priority)
        # Reads config, vocab size, params and this side's tokenizer only: safe off the loop thread.
        processed, max_tokens = self.engine.prepare_request(prompt, params, self._ctx)
        return self.add_prepared(request_id, processed, params, max_tokens, priority)

    async def add_request_async(self, prompt: PromptType, params: SamplingParams | None = None,
                                request_id: str | None = None, priority: int = 0) -> RequestStream:
        """``add_request`` with the preparation on the prep thread; the same errors, in the same order."""
        params = params or SamplingParams()
        request_id = request_id or f"req-{next(self._ids)}"
        self.check_new(request_id, priority)
        self._reserved.add(request_id)
        try:
            processed, max_tokens = await self.run_prep(self.prepare, prompt, params)
        finally:
            self._reserved.discard(request_id)
        return self.add_prepared(request_id, processed, params, max_tokens, priority)

    async def generate(self, prompt: PromptType, params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0,
                       delta: bool = False) -> AsyncIterator[RequestOutput]:
        """Outputs as they are produced: cumulative, or only what is new (``delta=True`` or the params'
        ``output_kind`` DELTA); ``output_kind`` FINAL_ONLY: the finished output alone. Leaving the loop early
        (break, cancellation, client gone) aborts the request."""
        stream = await self.add_request_async(prompt, params, request_id, priority)
        delta = delta or getattr(stream.params, "output_kind", None) is RequestOutputKind.DELTA
        async for out in self.iterate(stream, delta):
            yield out

    async def iterate(self, stream: RequestStream, delta: bool = False) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                out = await stream.next_output()
                view = stream.view(out, delta)
                if view is not None:
                    yield view
                if out.finished:
                    return
        finally:
            if not stream.finished:
                self.abort(stream.request_id)

    def abort(self, request_id: str) -> None:
        """End a request now: its KV blocks are freed on the loop's next turn."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        if not stream.finished:
            stream.finished = True
            self._report(stream, stream.latest, aborted=True)
        self._post(_Abort(request_id, self._epoch))

    def abort_all(self) -> list[RequestStream]:
        """Abort every request in flight (as ``abort``); their streams."""
        streams = list(self._streams.values())
        for stream in streams:
            self.abort(stream.request_id)
        return streams

    # ---- sleep mode, collective_rpc (docs/sleep_mode.md): run on the loop thread (core_calls.py) ----------
    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """vLLM's ``AsyncLLM.sleep``: new requests are refused (EngineSleepingError) from now on; ``mode``
        "abort" ends the requests in flight, "wait" lets them finish first (CoreCalls.sleep)."""
        await self.calls.sleep(level, mode)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.calls.call(lambda: self.engine.wake_up(tags))

    async def is_sleeping(self) -> bool:
        return await self.calls.call(self.engine.is_sleeping)

    async def collective_rpc(self, method: str | Callable[..., Any], args: tuple = (),
                             kwargs: dict[str, Any] | None = None) -> list[Any]:
        return await self.calls.call(lambda: self.engine.collective_rpc(method, args, kwargs))

    async def reset_prefix_cache(self) -> bool:
        return await self.calls.call(self.engine.reset_prefix_cache)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def _post(self, cmd: _Add | _Abort | CoreCall) -> None:
        with self._cond:
            self._inbox.append(cmd)
            self._cond.notify()
        if not self._wake_pending:
            # Once per turn of the asyncio loop, after what this turn posts (the prompts of one request
            # reach the engine core in one message): a pipe write would hand the GIL to the loop thread
            # after the first post.
            self._wake_pending = True
            try:
                if self._aloop is None:
                    raise RuntimeError("no asyncio loop yet")
                self._aloop.call_soon(self._wake_now)
            except RuntimeError:  # no loop, or it is closed: wake at once
                self._wake_now()

    def _wake_now(self) -> None:
        self._wake_pending = False
        self.core.wake()

    def _dispatch(self, outputs: list[RequestOutput], failed: list[tuple[str, BaseException]],
                  fatal: bool = False) -> None:
        """Hand outputs to their streams; ``failed`` with an empty id fails every stream (the core died),
        and ``fatal`` (it stays dead) runs the ``on_dead`` callbacks."""
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted meanwhile
            errors = [c.error or "failed" for c in out.outputs if c.finish_reason == "error"]
            if errors:  # this request failed alone: its stream raises, its other completions stop
                del self._streams[out.request_id]
                stream._fail(RequestFailedError(out.request_id, errors[0]))
                self._report(stream, out, aborted=False)
                if not out.finished:
                    self._post(_Abort(out.request_id, self._epoch))
                continue
            stream._put(out)
            if out.finished:
                del self._streams[out.request_id]
                self._report(stream, out, aborted=False)
        for rid, exc in failed:
            stream = self._streams.pop(rid, None) if rid else None
            targets = [stream] if stream is not None else []
            if not rid:  # the loop died: every request fails
                targets = list(self._streams.values())
                self._streams.clear()
            for s in targets:
                s._fail(exc)
                self._report(s, s.latest, aborted=True)
            if not rid and fatal:
                for cb in self.on_dead:
                    try:
                        cb(self.dead or exc)
                    except Exception:  # a callback must not stop the others
                        logger.exception("on_dead callback failed")

    def _report(self, stream: RequestStream, out: RequestOutput | None, aborted: bool) -> None:
        """Tell the observers a request ended; a failure here is logged and never stops the dispatch of
        the other requests' outputs."""
        try:
            rec = stream.report(out, aborted)
            rec.engine_index = self.core.engine_of(stream.request_id)
        except Exception:
            logger.exception("request report failed")
            return
        self._notify(rec)

    def _notify(self, rec: FinishedRequest) -> None:
        for obs in self.observers:
            try:
                obs(rec)
            except Exception:  # an observer must never break serving
                logger.exception("request observer failed")

    # ---- engine loop thread ----------------------------------------------------------------
    def _apply(self, cmds: list[_Add | _Abort | CoreCall]) -> list[tuple[str, BaseException]]:
        failed = []
        for cmd in cmds:
            if isinstance(cmd, CoreCall):  # it needs every core: while one restarts, it waits for it
                self.calls.run(cmd, restarting=self._restarter.cause is not None)
                continue
            if cmd.epoch != self._epoch:  # queued for a core that died: its stream has failed already
                continue
            try:
                if isinstance(cmd, _Add):
                    self.engine.add_prepared_request(cmd.request_id, cmd.processed, cmd.params, cmd.max_tokens,
                                                     cmd.priority, streamed=True)
                else:
                    self.engine.abort_request(cmd.request_id)
            except Exception as e:  # prepared on the asyncio side, so this is unexpected
                logger.exception("engine refused %s", cmd)
                if isinstance(cmd, _Add):
                    failed.append((cmd.request_id, e))
        return failed

    def _run(self) -> None:
        st = self.loop_stats
        st.thread_id = threading.get_native_id()
        engine, core = self.engine, self.core
        trimmer = HeapTrimmer()
        while True:
            st.trim_s += trimmer.maybe_trim(idle=not self._inbox and not engine.has_unfinished_requests())
            t_wait = time.perf_counter()
            with self._cond:
                while not self._inbox and not self._stopping and not engine.has_unfinished_requests():
                    wait_s = self._restarter.wait_s()
                    if wait_s is not None:  # a core restarts: look again soon
                        self._cond.wait(wait_s)
                        break
                    self._cond.wait()
                if self._stopping:
                    return
                cmds, self._inbox = self._inbox, []
            t0 = time.perf_counter()
            st.idle_s += t0 - t_wait
            failed = self._apply(cmds) if cmds else []
            outputs: list[RequestOutput] = []
            ran = False
            step_s = 0.0
            before = self.snapshot.step_times.steps
            if engine.has_unfinished_requests():
                t1 = time.perf_counter()
                try:
                    outputs = engine.step()
                except Exception as e:
                    failed.extend(self._core_died(e))
                step_s = time.perf_counter() - t1
                st.step_s += step_s
                st.steps += 1
                trimmer.note_work()
            self.snapshot = core.stats()
            ran = self.snapshot.step_times.steps != before
            if (outputs or failed) and not self._hand_over(outputs, failed, self.dead is not None):
                return
            st.other_s += time.perf_counter() - t0 - step_s
            if self._restarter.cause is not None and self.dead is None and self._restarter.advance():
                self._restart_ended()
            if self.dead is not None or self._stopping:
                return
            if not ran and not cmds:
                t2 = time.perf_counter()
                with self._cond:  # nothing could be scheduled: do not spin
                    if not self._inbox and not self._stopping:
                        self._cond.wait(_BACKOFF_S)
                st.idle_s += time.perf_counter() - t2

    def _hand_over(self, outputs: list[RequestOutput], failed: list[tuple[str, BaseException]], fatal: bool) -> bool:
        """Dispatch on the asyncio loop; False when that loop is closed (shutting down)."""
        if self._aloop is None:
            return True
        try:
            self._aloop.call_soon_threadsafe(self._dispatch, outputs, failed, fatal)
        except RuntimeError:
            return False
        return True

    def _core_died(self, e: Exception) -> list[tuple[str, BaseException]]:
        """A step raised: the streams to fail (an empty id: all). A dead engine-core process within the
        restart budget starts again (only the dead data-parallel core's requests fail); else it is dead."""
        exc = e if isinstance(e, EngineDeadError) else EngineDeadError(f"the engine died: a step failed with {e!r}")
        lost = e.request_ids if isinstance(e, EngineCoreDeadError) else None
        parents = self.engine.parents_of(lost) if lost is not None else set()
        if not self._restarter.core_died(exc, lost):
            logger.exception("engine step failed (a fault of no single request); the engine is dead")
            self.dead = e
            self.calls.fail_deferred(EngineDeadError(f"the engine loop stopped: {e!r}"))
            return [("", exc)]
        if lost is None:
            self._epoch += 1  # what was queued before never reaches the new core
            return [("", exc)]
        return [(rid, exc) for rid in parents]

    def _restart_ended(self) -> None:
        """On the loop thread: the restarted core(s) serve (the calls that waited run now), or the budget is
        spent (the engine is dead: ``on_dead`` runs)."""
        cause = self._restarter.gave_up
        if cause is None:
            self.snapshot = self.core.stats()
            self.calls.run_deferred()
            return
        self.dead = cause
        self.calls.fail_deferred(EngineDeadError(f"the engine loop stopped: {cause!r}"))
        self._hand_over([], [("", EngineDeadError(f"the engine core died and was not restarted: {cause}"))], True)

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout=10)
        self._prep.shutdown(wait=False, cancel_futures=True)
        self.core.shutdown()
