"""Executors: how the engine core runs its workers (``distributed_executor_backend``)."""
from __future__ import annotations

from typing import Any

from vllite_core.config import VlliteConfig
from vllite_core.executor.base import Executor


def make_executor(config: VlliteConfig, platform: Any) -> Executor:
    backend = config.parallel_config.distributed_executor_backend
    if backend == "uni":
        from vllite_core.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config, platform)
    if backend == "mp":
        from vllite_core.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config, platform)
    from vllite_core.executor.ray_executor import RayExecutor

    return RayExecutor(config, platform)
