"""One rank's worker behind an RPC surface: the same calls whether it runs in a process of the mp
executor (``mp_worker.py``) or in a Ray actor (``ray_executor.py``)."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any


@dataclass
class RankInfo:
    """Where a rank sits: its global rank, its device index and rank count on its node, the group's
    rendezvous address."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    init_method: str


@dataclass
class ModelFacts:
    """What the engine process needs to know of the model the workers hold."""

    vocab_size: int
    kv_cache_groups: Any
    kv_cache_dtype: Any
    # LoRA on: (targets, in_features) in checkpoint coordinates, what adapters are checked against.
    lora_layout: tuple[dict, dict] | None = None
    weights_bytes: int = 0  # the model's parameters and buffers on this rank
    kv_cache_bytes_per_block: int = 0  # what one block id costs in every cache tensor of this rank


class WorkerWrapper:
    """Builds the rank's ``Worker`` after joining the tensor-parallel group; forwards calls to it."""

    def __init__(self) -> None:
        self.worker: Any = None
        self.rank_info: RankInfo | None = None

    def init_worker(self, config: Any, platform: Any, info: RankInfo) -> str:
        """Join the group, build the worker; returns this node's host name."""
        from vllite_core.distributed import init_tensor_parallel
        from vllite_core.plugins.manager import get_plugin_manager
        from vllite_core.worker.worker import Worker

        os.environ["LOCAL_RANK"] = str(info.local_rank)  # platforms pick their device by it
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(info.rank), str(info.world_size)
        self.rank_info = info
        init_tensor_parallel(info.rank, info.world_size, info.local_rank, info.local_world_size, info.init_method,
                             platform, pipeline_parallel_size=config.parallel_config.pipeline_parallel_size,
                             enable_expert_parallel=config.parallel_config.enable_expert_parallel)
        self.worker = Worker(config, platform, get_plugin_manager())
        return socket.gethostname()

    def load_model(self, source: Any, hf_config: Any, architecture: str) -> None:
        from model_registry.model_impl import resolve_model_impl
        from model_registry.registry import build_registry
        from vllite_core.pooling import setup as pooling_setup

        mc = self.worker.config.model_config
        impl = resolve_model_impl(build_registry(self.worker.pm), hf_config, mc.model_impl, mc.trust_remote_code)
        arch, model_cls = impl.architecture, impl.model_cls
        model_cls = pooling_setup.resolve_model_class(arch, model_cls, mc.runner, mc.convert)
        self.worker.load_model(source, hf_config, architecture, model_cls)

    def model_facts(self) -> ModelFacts:
        return self.worker.model_facts()

    def run(self, method: str | bytes, args: tuple, kwargs: dict[str, Any]) -> Any:
        """The user's ``collective_rpc``: a method of the worker by name, or a function (cloudpickled by
        the engine) called with the worker first, as vLLM does."""
        if isinstance(method, bytes):
            import cloudpickle

            return cloudpickle.loads(method)(self.worker, *args, **kwargs)
        target = getattr(self.worker, method, None)
        if target is None or method.startswith("_") or not callable(target):
            raise ValueError(f"method: the worker has no method {method!r}")
        return target(*args, **kwargs)

    def call(self, method: str, *args: Any) -> Any:
        """A method of this wrapper, else of the worker. Only the output rank's step output is used (rank 0,
        or the first rank of the last pipeline stage): the other ranks return None rather than ship theirs."""
        target = getattr(self, method, None)
        if target is None:
            target = getattr(self.worker, method)
        result = target(*args)
        if method == "execute_model" and self.rank_info is not None and self.rank_info.rank != self.output_rank:
            return None
        return result

    @property
    def output_rank(self) -> int:
        return output_rank(self.worker.config.parallel_config)


def output_rank(parallel_config: Any) -> int:
    """The rank whose step output the engine reads: the first rank of the last pipeline stage (it samples)."""
    return (parallel_config.pipeline_parallel_size - 1) * parallel_config.tensor_parallel_size
