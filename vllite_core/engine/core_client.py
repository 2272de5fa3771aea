"""EngineCoreClient: how a frontend (LLMEngine, so AsyncLLM too) talks to its engine core.

One protocol, two implementations (as vLLM's EngineCoreClient family): ``InprocClient`` calls an
``EngineCore`` in this process; ``MPClient`` (mp_client.py) sends to engine cores in their own
processes (core_proc.py), one per data-parallel rank. The frontend reads the core through this
protocol only: ``info`` once (the finalized config, the model, its vocabulary), ``stats()`` as the one
``SchedulerStats`` record after each step, the request calls in between.

``VLLITE_ENABLE_V1_MULTIPROCESSING`` (or vLLM's ``VLLM_ENABLE_V1_MULTIPROCESSING``) = 0 keeps the
engine core in the API process (AsyncLLM's engine-loop thread); the server's default is 1.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Protocol

from vllite_core.core.stats import SchedulerStats
from vllite_core.engine.core import CoreInfo, EngineCore, EngineCoreOutput
from vllite_core.errors import ConfigError
from vllite_core.request import Request, RequestStatus
from vllite_core.worker.sleep import SleepReport

MULTIPROCESSING_ENV = ("VLLITE_ENABLE_V1_MULTIPROCESSING", "VLLM_ENABLE_V1_MULTIPROCESSING")


def multiprocessing_enabled(default: bool = True) -> bool:
    """The engine core in its own process? The first of MULTIPROCESSING_ENV that is set decides."""
    for name in MULTIPROCESSING_ENV:
        raw = os.environ.get(name, "").strip().lower()
        if not raw:
            continue
        if raw in ("1", "true", "yes", "on"):
            return True
        if raw in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{name}: must be 0 or 1, got {os.environ[name]!r}")
    return default


class EngineCoreClient(Protocol):
    """What a frontend may ask of its engine core. Request calls come from one thread (the engine loop);
    ``wake`` and ``remove_lora`` may come from another."""

    info: CoreInfo
    # Called (from a monitor thread) when an engine core dies on its own; never for an in-process core.
    on_failure: list[Callable[[], None]]
    # Whether ``restart`` can bring a dead core back (an engine-core process can be started again).
    restartable: bool

    def add_request(self, request: Request) -> None: ...

    def abort_requests(self, request_ids: list[str]) -> None: ...

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """End a request the frontend saw finish (a stop string)."""

    def has_unfinished_requests(self) -> bool: ...

    def get_num_unfinished_requests(self) -> int: ...

    def step(self) -> list[EngineCoreOutput]:
        """The outputs of one engine step (maybe none); EngineDeadError once the core is gone."""

    def stats(self) -> SchedulerStats:
        """The numbers after the latest step, every engine core's together."""

    def engine_stats(self) -> list[SchedulerStats]:
        """Each data-parallel engine core's own numbers, by index."""

    def engine_of(self, request_id: str) -> int:
        """The data-parallel engine core a (recent) request was sent to."""

    def num_kv_blocks(self) -> int:
        """KV cache blocks allocated, every engine core's together (vLLM's num_gpu_blocks)."""

    def reset_prefix_cache(self) -> bool: ...

    def remove_lora(self, lora_int_id: int) -> None:
        """Drop an adapter from the cores' own adapter caches (running requests keep theirs)."""

    def layout(self) -> dict[str, Any]:
        """The API process and each engine core's process and data-parallel rank."""

    def wake(self) -> None:
        """Make a ``step`` that waits for outputs return now (new requests or aborts to send)."""

    # Restart (restartable cores), in steps that never wait for a model load, so live cores keep serving.
    def drop_dead(self, keep_live: bool = False) -> None:
        """After a death: forget every request sent before (``keep_live``: only the dead cores' ones; live
        data-parallel cores keep theirs and serve on)."""

    def start_dead(self) -> None:
        """Start the dead core(s) again (their model loads); ``poll_started`` says when they serve."""

    def poll_started(self, wait_s: float = 0.0) -> bool:
        """Whether the cores ``start_dead`` started serve now; raises what a start-up raised."""

    # Sleep mode and the user's RPCs (docs/sleep_mode.md): answered calls, from the thread that steps.
    def sleep(self, level: int) -> list[SleepReport]:
        """Every engine core's workers release their KV cache (and weights, level 2); each rank's bytes."""

    def wake_up(self, tags: list[str] | None) -> None: ...

    def is_sleeping(self) -> bool: ...

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple,
                       kwargs: dict[str, Any] | None) -> list[Any]:
        """Every rank's result (every engine core's ranks, in engine order)."""

    def shutdown(self) -> None: ...


class InprocClient:
    """The engine core in this process: each call is the core's own, on the caller's thread."""

    def __init__(self, engine_core: EngineCore) -> None:
        self.engine_core = engine_core
        self.info = engine_core.info()
        self.on_failure: list[Callable[[], None]] = []
        self.restartable = False  # a failed step leaves this process's core in an unknown state

    def add_request(self, request: Request) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        self.engine_core.finish_request(request_id, status)

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.engine_core.get_num_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        return self.engine_core.step()

    def stats(self) -> SchedulerStats:
        return self.engine_core.stats()

    def engine_stats(self) -> list[SchedulerStats]:
        return [self.engine_core.stats()]

    def engine_of(self, request_id: str) -> int:
        return 0

    def num_kv_blocks(self) -> int:
        return self.info.model_info.num_kv_blocks

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def remove_lora(self, lora_int_id: int) -> None:
        self.engine_core.remove_lora(lora_int_id)  # the workers' own caches

    def layout(self) -> dict[str, Any]:
        return {"api_pid": os.getpid(), "data_parallel_size": 1,
                "engine_cores": [{"dp_rank": 0, "pid": os.getpid(), "in_process": True}]}

    def wake(self) -> None:
        """Nothing waits: ``step`` returns when the core's step does."""

    def drop_dead(self, keep_live: bool = False) -> None:
        raise NotImplementedError("an in-process engine core is not restarted (restartable is False)")

    def start_dead(self) -> None:
        raise NotImplementedError("an in-process engine core is not restarted (restartable is False)")

    def poll_started(self, wait_s: float = 0.0) -> bool:
        raise NotImplementedError("an in-process engine core is not restarted (restartable is False)")

    def sleep(self, level: int) -> list[SleepReport]:
        return self.engine_core.sleep(level)

    def wake_up(self, tags: list[str] | None) -> None:
        self.engine_core.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine_core.is_sleeping()

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple,
                       kwargs: dict[str, Any] | None) -> list[Any]:
        return self.engine_core.collective_rpc(method, args, kwargs)

    def shutdown(self) -> None:
        self.engine_core.shutdown()
