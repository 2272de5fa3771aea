"""The parallel layout as people read it: ranks, processes, nodes, devices, pipeline stages and their layers
(``vllite env``, ``vllite serve``)."""
from __future__ import annotations

from typing import Any

from vllite_core.config import ConfigError


def planned_layout(platform: Any, tensor_parallel_size: int, backend: str | None, pipeline_parallel_size: int = 1,
                   hf_config: Any = None, model_cls: Any = None) -> dict[str, Any]:
    """What an engine with these settings would start here, without starting it. With a model's config (and
    class), what it cannot take is refused (ConfigError naming the field): fewer layers than stages, heads that
    do not split, a class without tensor parallelism or pipeline stages; and each tensor-parallel rank's share
    (its heads) as the class describes it (``tensor_parallel_layout``)."""
    from vllite_core.config import ParallelConfig
    from vllite_core.distributed.checks import PIPELINE_CLASSES, num_decoder_layers
    from vllite_core.distributed.pipeline import stage_layer_counts

    pc = ParallelConfig(tensor_parallel_size, backend, pipeline_parallel_size)
    shards: list[str] = []
    tp, pp, backend, world = pc.tensor_parallel_size, pc.pipeline_parallel_size, pc.distributed_executor_backend, \
        pc.world_size
    if model_cls is not None:
        if pp > 1 and not getattr(model_cls, "supports_pipeline_parallel", False):
            raise ConfigError(f"pipeline_parallel_size: {model_cls.__name__} does not support pipeline parallelism "
                              f"(only {PIPELINE_CLASSES}); use pipeline_parallel_size=1")
        if tp > 1 and hasattr(model_cls, "check_tensor_parallel"):
            model_cls.check_tensor_parallel(hf_config, tp)
            describe = getattr(model_cls, "tensor_parallel_layout", None)  # each rank's heads
            shards = describe(hf_config, tp) if describe is not None else []
        elif tp > 1:
            raise ConfigError(f"tensor_parallel_size: {model_cls.__name__} does not support tensor parallelism")
    if backend == "uni":
        processes = ["rank 0: the engine process"]
    elif backend == "mp":
        processes = [f"rank {r}: worker process {r + 1} of {world} on this host" for r in range(world)]
    else:
        processes = [f"rank {r}: a Ray actor (placement group bundle {r})" for r in range(world)]
    devices = [str(platform.device(r)) for r in range(world)] if backend != "ray" else ["placed by Ray"]
    layout = {"backend": backend, "ranks": world, "nodes": 1 if backend != "ray" else "the Ray cluster's",
              "processes": processes, "devices": devices,
              "dist_backend": platform.dist_backend if world > 1 else "-", "device_count": platform.device_count(),
              "tensor_parallel_size": tp, "pipeline_parallel_size": pp}
    if shards:
        layout["tensor_parallel_shards"] = shards  # the same heads on the same TP rank of every stage
    if pp > 1:
        counts = stage_layer_counts(num_decoder_layers(hf_config), pp) if hf_config is not None else None
        stages = []
        describe_kinds = getattr(model_cls, "layer_kinds", None)  # a hybrid's layer kinds (Jamba)
        kinds = describe_kinds(hf_config) if describe_kinds is not None and hf_config is not None else None
        multimodal = model_cls is not None and hasattr(model_cls, "embed_multimodal")
        pooling = model_cls is not None and hasattr(model_cls, "pool")
        for s in range(pp):
            ranks = f"ranks {s * tp}-{(s + 1) * tp - 1}" if tp > 1 else f"rank {s}"
            parts = []
            if counts is not None:
                start = sum(counts[:s])
                parts.append(f"layers {start}-{start + counts[s] - 1} ({counts[s]})")
                if kinds:  # a hybrid: which caches this stage holds
                    here = kinds[start:start + counts[s]]
                    parts.append(" + ".join(f"{here.count(k)} {k}" for k in dict.fromkeys(here)))
            else:
                parts.append("an even share of the layers (vLLM's split; pass --model to see it)")
            if s == 0:
                parts.append("the embedding" + (" and the vision encoder" if multimodal else ""))
            if s == pp - 1:
                parts.append("the final norm and the pooler (pools)" if pooling
                             else "the final norm and the LM head (samples)")
            stages.append(f"stage {s}: {ranks}: " + ", ".join(parts))
        layout["stages"] = stages
    return layout


def format_layout(layout: dict[str, Any]) -> list[str]:
    tp, pp = layout.get("tensor_parallel_size", layout["ranks"]), layout.get("pipeline_parallel_size", 1)
    shape = f" (tensor_parallel_size {tp} x pipeline_parallel_size {pp})" if pp > 1 else ""
    lines = [f"parallel:      {layout['ranks']} rank(s){shape}, {layout['backend']} executor, "
             f"{layout['nodes']} node(s), collectives {layout.get('dist_backend', '-')}"]
    lines += [f"  {p}" for p in layout["processes"]]
    lines += [f"  {s}" for s in layout.get("stages", [])]
    lines += [f"  {s}" for s in layout.get("tensor_parallel_shards", [])]
    if "kv_blocks_per_stage" in layout:
        lines.append("  KV blocks per stage: " + ", ".join(f"stage {s}: {n}"
                                                          for s, n in enumerate(layout["kv_blocks_per_stage"])))
    lines.append(f"  devices: {', '.join(layout['devices'])}"
                 + (f" (this host has {layout['device_count']})" if "device_count" in layout else ""))
    if layout["backend"] == "mp" and layout["ranks"] > layout.get("device_count", layout["ranks"]):
        name = "tensor_parallel_size" if pp == 1 else "pipeline_parallel_size"
        lines.append(f"  error: {layout['ranks']} ranks need {layout['ranks']} devices on this host; the engine "
                     f"would refuse ({name})")
    return lines
