"""The ``uni`` executor: one worker, in the engine core's own process."""
from __future__ import annotations

from typing import Any

from vllite_core.config import VlliteConfig
from vllite_core.executor.base import Executor
from vllite_core.executor.wrapper import WorkerWrapper


class UniProcExecutor(Executor):
    backend = "uni"

    def __init__(self, config: VlliteConfig, platform: Any) -> None:
        super().__init__(config, platform)
        from vllite_core.plugins.manager import get_plugin_manager
        from vllite_core.worker.worker import Worker

        # No process group: this process is rank 0 of 1 (vllite_core.distributed's default state).
        self.wrapper = WorkerWrapper()
        self.wrapper.worker = Worker(config, platform, get_plugin_manager())
        self.layout = {"backend": "uni", "ranks": 1, "processes": [f"rank 0: pid {_pid()} (engine process)"],
                       "nodes": 1, "devices": [str(platform.device())]}

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return [self.wrapper.call(method, *args)]

    def load_model(self, source: Any, hf_config: Any, architecture: str, model_cls: type) -> None:
        self.wrapper.worker.load_model(source, hf_config, architecture, model_cls)
        self.facts = self.wrapper.model_facts()

    @property
    def driver_worker(self) -> Any:
        return self.wrapper.worker


def _pid() -> int:
    import os

    return os.getpid()
