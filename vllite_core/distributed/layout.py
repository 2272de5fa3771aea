"""The parallel layout as people read it: ranks, processes, nodes, devices (``vllite env``, ``vllite serve``)."""
from __future__ import annotations

from typing import Any


def planned_layout(platform: Any, tensor_parallel_size: int, backend: str | None) -> dict[str, Any]:
    """What an engine with these settings would start here, without starting it."""
    from vllite_core.config import ParallelConfig

    pc = ParallelConfig(tensor_parallel_size, backend)
    tp, backend = pc.tensor_parallel_size, pc.distributed_executor_backend
    if backend == "uni":
        processes = ["rank 0: the engine process"]
    elif backend == "mp":
        processes = [f"rank {r}: worker process {r + 1} of {tp} on this host" for r in range(tp)]
    else:
        processes = [f"rank {r}: a Ray actor (placement group bundle {r})" for r in range(tp)]
    devices = [str(platform.device(r)) for r in range(tp)] if backend != "ray" else ["placed by Ray"]
    return {"backend": backend, "ranks": tp, "nodes": 1 if backend != "ray" else "the Ray cluster's",
            "processes": processes, "devices": devices, "dist_backend": platform.dist_backend if tp > 1 else "-",
            "device_count": platform.device_count()}


def format_layout(layout: dict[str, Any]) -> list[str]:
    lines = [f"parallel:      {layout['ranks']} rank(s), {layout['backend']} executor, "
             f"{layout['nodes']} node(s), collectives {layout.get('dist_backend', '-')}"]
    lines += [f"  {p}" for p in layout["processes"]]
    lines.append(f"  devices: {', '.join(layout['devices'])}"
                 + (f" (this host has {layout['device_count']})" if "device_count" in layout else ""))
    if layout["backend"] == "mp" and layout["ranks"] > layout.get("device_count", layout["ranks"]):
        lines.append(f"  error: {layout['ranks']} ranks need {layout['ranks']} devices on this host; the engine "
                     "would refuse (tensor_parallel_size)")
    return lines
