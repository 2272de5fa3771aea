"""Executors run the model's workers for the engine core: in its own process (``uni``), one process per
rank on this machine (``mp``), or Ray actors across a cluster (``ray``). The core calls the same five
methods whichever runs; every rank gets every call and the results come from the output rank (rank 0, or
the first rank of the last pipeline stage, which samples)."""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol

from vllite_core.config import VlliteConfig
from vllite_core.core.sched_output import SchedulerOutput
from vllite_core.executor.wrapper import ModelFacts, output_rank
from vllite_core.worker.model_runner import ModelRunnerOutput
from vllite_core.worker.sleep import SleepReport

logger = logging.getLogger("vllite.executor")


class StepHandle(Protocol):
    """A step sent to the workers: ``result()`` waits for the output rank's output (steps come back in the
    order they were sent)."""

    def result(self) -> ModelRunnerOutput: ...


@dataclass
class DoneStep:
    """A step that ran before its handle was returned (an executor that runs one step at a time)."""

    output: ModelRunnerOutput

    def result(self) -> ModelRunnerOutput:
        return self.output


class Executor(ABC):
    backend: str = "abstract"

    def __init__(self, config: VlliteConfig, platform: Any) -> None:
        self.config = config
        self.platform = platform
        self.facts: ModelFacts | None = None
        self.layout: dict[str, Any] = {}  # ranks, processes, nodes, devices (what `vllite serve` prints)

    @abstractmethod
    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call ``method`` on every rank's worker (``WorkerWrapper.call``); the results in rank order."""

    @property
    def output_rank(self) -> int:
        return output_rank(self.config.parallel_config)

    def load_model(self, source: Any, hf_config: Any, architecture: str, model_cls: type) -> None:
        self.collective_rpc("load_model", source, hf_config, architecture)
        facts = self.collective_rpc("model_facts")
        self.facts = facts[self.output_rank]
        if self.config.parallel_config.pipeline_parallel_size > 1:
            from vllite_core.distributed.checks import stage_cache_groups

            pc = self.config.parallel_config
            per_tp = stage_cache_groups(facts, pc)
            if any([g.spec for g in f.kv_cache_groups] != per_tp[r % pc.tensor_parallel_size]
                   for r, f in enumerate(facts)):  # a stage lacks some group: every rank takes the union
                self.collective_rpc("align_kv_cache_groups", per_tp)
                self.facts = self.collective_rpc("model_facts")[self.output_rank]

    def determine_num_kv_blocks(self) -> int:
        """Each rank sizes its own cache (its KV heads, its layers, its memory); every rank must hold them all.
        With pipeline stages each holds only its layers' cache, and the blocks of each stage are reported."""
        per_rank = self.collective_rpc("determine_num_kv_blocks")
        pc = self.config.parallel_config
        if pc.pipeline_parallel_size > 1:
            tp = pc.tensor_parallel_size
            per_stage = [min(per_rank[s * tp:(s + 1) * tp]) for s in range(pc.pipeline_parallel_size)]
            self.layout["kv_blocks_per_stage"] = per_stage
            logger.info("KV cache blocks per pipeline stage: %s (the engine uses %d, the fewest)",
                        ", ".join(f"stage {s}: {n}" for s, n in enumerate(per_stage)), min(per_stage))
        return min(per_rank)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", num_blocks)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.collective_rpc("execute_model", so)[self.output_rank]

    @property
    def max_concurrent_batches(self) -> int:
        """Steps the engine core may keep in flight: one per pipeline stage (the first stage runs the next
        batch while the last samples this one)."""
        return self.config.parallel_config.pipeline_parallel_size

    def execute_model_async(self, so: SchedulerOutput) -> StepHandle:
        """Send a step without waiting for it (executors whose workers run apart override this)."""
        return DoneStep(self.execute_model(so))

    def remove_lora(self, lora_int_id: int) -> None:
        self.collective_rpc("remove_lora", lora_int_id)

    # ---- sleep mode and the user's RPCs (every rank; worker/sleep.py) -----------------------------------
    def sleep(self, level: int) -> list[SleepReport]:
        return self.collective_rpc("sleep", level)

    def wake_up(self, tags: list[str] | None) -> None:
        self.collective_rpc("wake_up", tags)

    def is_sleeping(self) -> bool:
        return any(self.collective_rpc("is_sleeping"))

    def run_on_workers(self, method: str | bytes, args: tuple, kwargs: dict[str, Any]) -> list[Any]:
        """``collective_rpc`` as vLLM's users call it: a worker method by name, or a cloudpickled function
        called with the worker first (``WorkerWrapper.run``); every rank's result, in rank order."""
        return self.collective_rpc("run", method, args, kwargs)

    @property
    def driver_worker(self) -> Any:
        """The in-process worker (``uni`` only; the others hold theirs in other processes)."""
        return None

    def shutdown(self) -> None:
        """Stop the workers (idempotent)."""
