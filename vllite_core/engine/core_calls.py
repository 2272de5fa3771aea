"""AsyncLLM's answered calls of its engine core: sleep mode, collective_rpc, a prefix-cache reset.

Each call is posted to the engine loop (the one thread that talks to the core, async_llm.py), run
there between steps, and its result or error is awaited on the asyncio side. While an engine core
restarts (engine/restart.py) calls wait until it serves: they need every core. docs/sleep_mode.md
describes the calls themselves.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from vllite_core.errors import EngineDeadError
from vllite_core.outputs import CompletionOutput, RequestOutput
from vllite_core.worker.sleep import check_level, check_mode

if TYPE_CHECKING:
    from vllite_core.engine.async_llm import AsyncLLM
    from vllite_core.engine.request_stream import RequestStream

_DRAIN_POLL_S = 0.02  # sleep(mode="wait"): how often it looks whether the requests in flight are done

T = TypeVar("T")


@dataclass
class CoreCall:
    """A call of the engine core's client, run on the loop thread; its result or error goes to ``future``."""

    fn: Callable[[], Any]
    future: concurrent.futures.Future


def aborted_output(stream: RequestStream) -> RequestOutput:
    """The last output of a request that sleep(mode="abort") ended: what it made so far, finish_reason
    "abort" (vLLM's), so its caller's stream ends as an abort does."""
    last = stream.latest
    if last is None:
        n = max(getattr(stream.params, "n", 1) or 1, 1)
        return RequestOutput(stream.request_id, None, [], None,
                             [CompletionOutput(i, "", [], None, None, "abort") for i in range(n)], True)
    outs = [dataclasses.replace(c, finish_reason=c.finish_reason or "abort") for c in last.outputs]
    return dataclasses.replace(last, outputs=outs, finished=True)


class CoreCalls:
    """The calls of one AsyncLLM: ``call`` and the sleep-mode API on the asyncio side, ``run`` and the
    deferred calls on the loop thread."""

    def __init__(self, llm: AsyncLLM, post: Callable[[CoreCall], None]) -> None:
        self.llm = llm
        self._post = post  # to the loop thread's inbox
        self.draining = False  # sleep() is under way: new requests are refused as while asleep
        self._deferred: list[CoreCall] = []  # calls that came while a core restarts: run once it serves

    # ---- asyncio side ------------------------------------------------------------------------
    async def call(self, fn: Callable[[], T]) -> T:
        if self.llm.dead is not None:
            raise EngineDeadError(f"the engine loop stopped: {self.llm.dead!r}")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._post(CoreCall(fn, future))
        return await asyncio.wrap_future(future)

    async def sleep(self, level: int, mode: str) -> None:
        """New requests are refused (EngineSleepingError) from now on. ``mode``: "abort" ends the requests
        in flight at once (their outputs so far, finish_reason "abort"); "wait" lets them finish first;
        "keep" is refused (worker/sleep.check_mode)."""
        check_level(level)
        check_mode(mode)
        llm = self.llm
        self.draining = True
        try:
            if mode == "wait":
                while llm.num_in_flight and llm.dead is None:
                    await asyncio.sleep(_DRAIN_POLL_S)
            for stream in llm.abort_all():  # reported as aborted; the engine frees them before the sleep
                stream._put(aborted_output(stream))
            await self.call(lambda: llm.engine.sleep(level, mode))
        finally:
            self.draining = False

    # ---- loop thread -------------------------------------------------------------------------
    def run(self, call: CoreCall, restarting: bool) -> None:
        """Run ``call`` now, or once the restart under way ends."""
        if restarting:
            self._deferred.append(call)
            return
        try:
            call.future.set_result(call.fn())
        except BaseException as e:  # noqa: BLE001 - the caller's error, raised where it awaits
            call.future.set_exception(e)

    def run_deferred(self) -> None:
        deferred, self._deferred = self._deferred, []
        for call in deferred:
            self.run(call, restarting=False)

    def fail_deferred(self, exc: BaseException) -> None:
        deferred, self._deferred = self._deferred, []
        for call in deferred:
            call.future.set_exception(exc)
