"""The parallel layout checked against the model and the platform before any worker starts."""
from __future__ import annotations

import logging
from typing import Any

from vllite_core.config import ConfigError, VlliteConfig

logger = logging.getLogger("vllite.engine")


def check_parallel_config(config: VlliteConfig, platform: Any, architecture: str, model_cls: Any,
                          hf_config: Any) -> None:
    """ConfigError naming the field: a model that cannot shard, heads that do not split, more ranks than
    one machine has devices."""
    pc = config.parallel_config
    tp, backend = pc.tensor_parallel_size, pc.distributed_executor_backend
    if tp == 1:
        return
    if not config.model_config.capabilities.supports_tensor_parallel:
        raise ConfigError(f"tensor_parallel_size: {architecture} does not support tensor parallelism (its model "
                          f"class does not declare SupportsTensorParallel); use tensor_parallel_size=1")
    model_cls.check_tensor_parallel(hf_config, tp)
    if pc.enable_expert_parallel:
        if config.model_config.capabilities.supports_expert_parallel:
            model_cls.check_expert_parallel(hf_config, tp)
        else:  # vLLM's behaviour: the option only concerns mixture-of-experts layers
            logger.warning("enable_expert_parallel: %s declares no expert-parallel layers; every layer stays "
                           "tensor-parallel", architecture)
    if backend == "mp":
        devices = platform.device_count()
        if tp > devices:
            raise ConfigError(f"tensor_parallel_size: {tp} ranks on this machine, but the {platform.name} platform "
                              f"has {devices} device(s) for them here (one rank per device); lower it, or use "
                              f"distributed_executor_backend='ray' to span machines")
