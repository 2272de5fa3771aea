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
    """Pipeline stages need a model class that builds only its stage's layers (``supports_pipeline_parallel``:
    the decoders of the layers package, the MoE decoders, Jamba, Llava, and their pooling forms), no
    speculative decoding or LoRA, and at least one layer per stage."""
    from vllite_core.distributed.pipeline import stage_layer_counts

    pp = config.parallel_config.pipeline_parallel_size
    if not getattr(model_cls, "supports_pipeline_parallel", False):
        raise ConfigError(f"pipeline_parallel_size: {architecture} ({model_cls.__name__}) does not support "
                          f"pipeline parallelism (only {PIPELINE_CLASSES}); use pipeline_parallel_size=1")
    unsupported = [(config.speculative_config is not None, "speculative decoding"),
                   (config.lora_config is not None, "LoRA")]
    for on, what in unsupported:
        if on:
            raise ConfigError(f"pipeline_parallel_size: {pp} stages do not run with {what} yet; use "
                              f"pipeline_parallel_size=1")
    stage_layer_counts(num_decoder_layers(hf_config), pp)


# The classes that build their stage's layers (what a refusal names).
PIPELINE_CLASSES = ("the decoders built from the layers package: the Llama and dense families, the MoE "
                    "decoders, Jamba, Llava, and their pooling forms")


def num_decoder_layers(hf_config: Any) -> int:
    """The decoder's layer count (a VLM's: its text config's)."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    return int(text.num_hidden_layers)


def stage_cache_groups(facts: list[Any], pc: ParallelConfig) -> list[list[Any]]:
    """The engine's cache groups over every stage (vLLM's way): each kind of cache any stage holds, in the order
    the stages first hold it, for each tensor-parallel rank (whose KV heads may differ from the others'). The
    scheduler keeps one block table per group; a stage without a group's layers holds none of its memory.
    Refused (ConfigError) only where one block pool cannot serve the stages: groups of different block sizes."""
    from vllite_core.core.kv_cache_spec import KVCacheSpec

    tp = pc.tensor_parallel_size
    per_tp: list[list[KVCacheSpec]] = []
    for t in range(tp):
        specs: list[KVCacheSpec] = []
        for stage in range(pc.pipeline_parallel_size):
            specs += [g.spec for g in facts[stage * tp + t].kv_cache_groups if g.spec not in specs]
        per_tp.append(specs)
    sizes = sorted({s.block_size for s in per_tp[0]})
    if len(sizes) > 1:
        raise ConfigError(f"pipeline_parallel_size: the stages' caches use different block sizes ({sizes}), which "
                          f"one block pool cannot serve; use another pipeline_parallel_size")
    kinds = {tuple(s.kind for s in specs) for specs in per_tp}
    assert len(kinds) == 1, f"the tensor-parallel ranks' cache groups differ in kind: {kinds}"
    return per_tp
