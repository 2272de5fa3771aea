"""The parallel layout checked against the model and the platform before any worker starts."""
from __future__ import annotations

import logging
from typing import Any

from vllite_core.config import ConfigError, ParallelConfig, VlliteConfig

logger = logging.getLogger("vllite.engine")


def check_parallel_config(config: VlliteConfig, platform: Any, architecture: str, model_cls: Any,
                          hf_config: Any) -> None:
    """ConfigError naming the field: a model that cannot shard or be split into stages, heads that do not
    split, layers fewer than stages, more ranks than one machine has devices."""
    pc = config.parallel_config
    tp, pp, backend = pc.tensor_parallel_size, pc.pipeline_parallel_size, pc.distributed_executor_backend
    if pp > 1:
        check_pipeline_parallel(config, architecture, model_cls, hf_config)
    if tp > 1:
        if not config.model_config.capabilities.supports_tensor_parallel:
            raise ConfigError(f"tensor_parallel_size: {architecture} does not support tensor parallelism (its "
                              f"model class does not declare SupportsTensorParallel); use tensor_parallel_size=1")
        model_cls.check_tensor_parallel(hf_config, tp)
        if pc.enable_expert_parallel:
            if config.model_config.capabilities.supports_expert_parallel:
                model_cls.check_expert_parallel(hf_config, tp)
            else:  # vLLM's behaviour: the option only concerns mixture-of-experts layers
                logger.warning("enable_expert_parallel: %s declares no expert-parallel layers; every layer stays "
                               "tensor-parallel", architecture)
    world = pc.world_size
    if world > 1 and backend == "mp":
        devices = platform.device_count()
        if world > devices:
            name, shape = ("tensor_parallel_size", "") if pp == 1 else (
                "pipeline_parallel_size", f" (tensor_parallel_size={tp} x pipeline_parallel_size={pp})")
            raise ConfigError(f"{name}: {world} ranks{shape} on this machine, but the {platform.name} platform has "
                              f"{devices} device(s) for them here (one rank per device); lower it, or use "
                              f"distributed_executor_backend='ray' to span machines")


def check_pipeline_parallel(config: VlliteConfig, architecture: str, model_cls: Any, hf_config: Any) -> None:
    """Pipeline stages need a model class that builds only its stage's layers (the dense decoders of the
    layers package), plain generation, and at least one layer per stage."""
    from vllite_core.distributed.pipeline import stage_layer_counts

    pp = config.parallel_config.pipeline_parallel_size
    if not getattr(model_cls, "supports_pipeline_parallel", False):
        raise ConfigError(f"pipeline_parallel_size: {architecture} ({model_cls.__name__}) does not support "
                          f"pipeline parallelism (only the dense decoders built from the layers package: the "
                          f"Llama family and the dense families); use pipeline_parallel_size=1")
    caps = config.model_config.capabilities
    unsupported = [(config.speculative_config is not None, "speculative decoding"),
                   (config.lora_config is not None, "LoRA"),
                   (caps.is_pooling or config.model_config.pooler_config is not None, "pooling models"),
                   (caps.supports_multimodal or caps.is_encoder_decoder, "multimodal or encoder-decoder models")]
    for on, what in unsupported:
        if on:
            raise ConfigError(f"pipeline_parallel_size: {pp} stages do not run with {what} yet; use "
                              f"pipeline_parallel_size=1")
    stage_layer_counts(int(hf_config.num_hidden_layers), pp)


def check_stage_cache_groups(facts: list[Any], pc: ParallelConfig) -> None:
    """Every stage must have the same cache groups (the scheduler keeps one block table per group for all of
    them): a model whose stages differ (sliding-window layers only in one stage) is refused."""
    tp = pc.tensor_parallel_size
    stages = [[g.spec for g in facts[s * tp].kv_cache_groups] for s in range(pc.pipeline_parallel_size)]
    if any(s != stages[0] for s in stages[1:]):
        raise ConfigError(f"pipeline_parallel_size: the stages' layers have different KV cache kinds "
                          f"({'; '.join(str([type(x).__name__ for x in s]) for s in stages)}), which one block "
                          f"table per kind cannot serve; use another pipeline_parallel_size")
