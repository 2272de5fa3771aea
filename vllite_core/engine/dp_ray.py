"""``--data-parallel-backend ray``: the head node's API server places the data-parallel ranks past
``--data-parallel-size-local`` on the other nodes of a running Ray cluster itself, where ``mp`` needs a
``--headless`` node started on each.

Each such rank is one Ray actor pinned to a node (the other nodes first, in turn; the head's own node
only when the cluster has no other), holding the rank's devices (``tensor_parallel_size x
pipeline_parallel_size`` CPUs or accelerators). The actor runs what a headless node runs for one rank
(cli_headless.HeadlessNode): the engine-core process that connects to the front end over TCP, started
again when it exits; so the front end sees it exactly as a headless node's core (dp_layout.py), and a
lost node is seen by the link heartbeats. The API server kills its actors when it stops.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

from vllite_core.config import ConfigError, VlliteConfig
from vllite_core.engine.dp_layout import DataParallelLayout
from vllite_core.engine.restart import RestartPolicy

logger = logging.getLogger("vllite.data_parallel")

PLACEMENT_TIMEOUT_S = 60.0


class DataParallelRankActor:
    """A Ray actor running one data-parallel rank's engine-core process (restarted when it exits)."""

    def __init__(self, config: VlliteConfig, layout: DataParallelLayout, policy: RestartPolicy) -> None:
        from vllite_core.entrypoints.cli_headless import HeadlessNode

        self.node = HeadlessNode(config, layout, policy)
        self.node.start()
        threading.Thread(target=self.node.supervise, name="vllite-dp-rank", daemon=True).start()

    def where(self) -> tuple[str, str, int]:
        """(node id, node IP, the engine core's pid)."""
        import ray

        (proc,) = self.node.procs.values()
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), proc.pid

    def stop(self) -> None:
        self.node.stop()
        self.node.close()


def front_end_address(layout: DataParallelLayout) -> DataParallelLayout:
    """The layout with the address the ranks connect to: --data-parallel-address, else this node's IP
    as the Ray cluster knows it (a connection made only to ask is closed again, so that the one
    ``RayDataParallelRanks`` makes is its own to close)."""
    if layout.address is not None:
        return layout
    from vllite_core.executor.ray_executor import _connect, _import_ray

    ray = _import_ray()
    connected = _connect(ray)
    try:
        return dataclasses.replace(layout, address=ray.util.get_node_ip_address())
    finally:
        if connected:
            ray.shutdown()


class RayDataParallelRanks:
    """The ranks this API server placed on the Ray cluster (``layout.size_local`` .. ``layout.size - 1``)."""

    def __init__(self, config: VlliteConfig, layout: DataParallelLayout, policy: RestartPolicy) -> None:
        from vllite_core.executor.ray_executor import _connect, _import_ray

        ray = self.ray = _import_ray()
        self._owns_ray = _connect(ray)
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        pc = config.parallel_config
        from vllite_core.platforms.resolve import resolve_platform

        resource = "CPU" if resolve_platform(config.device_config.device).platform.device_type == "cpu" else "GPU"
        per_rank = pc.world_size
        here = ray.get_runtime_context().get_node_id()
        nodes = [n for n in ray.nodes() if n.get("Alive") and n["Resources"].get(resource, 0) >= per_rank]
        others = [n["NodeID"] for n in nodes if n["NodeID"] != here]
        targets = others or [n["NodeID"] for n in nodes]
        if not targets:
            raise ConfigError(f"data_parallel_backend: no node of the Ray cluster has {per_rank} {resource} for a "
                              f"data-parallel rank (tensor_parallel_size x pipeline_parallel_size); the cluster has "
                              f"{ray.cluster_resources()}")
        opts = {"num_cpus": per_rank} if resource == "CPU" else {"num_gpus": per_rank, "num_cpus": 0}
        actor_cls = ray.remote(DataParallelRankActor)
        self.actors: list[Any] = []
        self.where: dict[int, tuple[str, str, int]] = {}
        try:
            for i, rank in enumerate(range(layout.size_local, layout.size)):
                mine = DataParallelLayout(layout.size, 1, rank, layout.address, layout.rpc_port, headless=True)
                strategy = NodeAffinitySchedulingStrategy(targets[i % len(targets)], soft=False)
                self.actors.append(actor_cls.options(scheduling_strategy=strategy, **opts).remote(config, mine, policy))
            refs = [a.where.remote() for a in self.actors]
            _, pending = ray.wait(refs, num_returns=len(refs), timeout=PLACEMENT_TIMEOUT_S)
            if pending:
                raise ConfigError(f"data_parallel_backend: the Ray cluster could not place {len(pending)} "
                                  f"data-parallel rank(s) of {opts} in {PLACEMENT_TIMEOUT_S:.0f}s (available: "
                                  f"{ray.available_resources()})")
            for rank, got in zip(range(layout.size_local, layout.size), ray.get(refs)):
                self.where[rank] = got
        except BaseException:
            self.stop()
            raise
        logger.info("data-parallel ranks on the Ray cluster: %s", ", ".join(
            f"rank {r} on node {nid[:12]} ({ip}) pid {pid}" for r, (nid, ip, pid) in self.where.items()))

    def stop(self) -> None:
        for actor in self.actors:
            try:
                self.ray.get(actor.stop.remote(), timeout=15)
            except Exception:  # noqa: BLE001 - a lost node: killing it is all that is left
                pass
            self.ray.kill(actor)
        self.actors = []
        if self._owns_ray:
            self.ray.shutdown()
            self._owns_ray = False
