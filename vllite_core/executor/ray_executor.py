"""The ``ray`` executor: each rank's worker is a Ray actor, placed with a placement group, so one engine
spans the machines of a Ray cluster (``ray start --head`` on one, ``ray start --address=HEAD:PORT`` on
the others).

The engine connects to a running cluster (``RAY_ADDRESS``, else ``auto``); it never starts one. One
bundle per rank holds the device it needs (a CPU core, or one accelerator); when the cluster cannot
hold them the error says what was asked and what the cluster has. Ranks join one torch.distributed
group at rank 0's node. A lost actor fails the call with ``WorkerDiedError`` naming the rank and its
node; the other actors are then killed, so nothing waits on a lost peer.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Any

from vllite_core.config import ConfigError, VlliteConfig
from vllite_core.core.sched_output import SchedulerOutput
from vllite_core.executor.base import Executor, StepHandle
from vllite_core.executor.errors import WorkerDiedError
from vllite_core.executor.wrapper import RankInfo, WorkerWrapper
from vllite_core.worker.model_runner import ModelRunnerOutput

logger = logging.getLogger("vllite.executor")

PLACEMENT_TIMEOUT_S = 60.0
DEATH_GRACE_S = 5.0  # how long the other ranks get to show a dead actor once one rank's task failed


class RayWorker(WorkerWrapper):
    """The actor: a worker wrapper that can also say where it runs."""

    def node(self) -> tuple[str, str, str]:
        import socket

        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), socket.gethostname()

    def free_port(self) -> int:
        from vllite_core.executor.multiproc import free_port

        return free_port("0.0.0.0")


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError("distributed_executor_backend: 'ray' needs the ray package, which is not installed "
                          "(pip install 'ray==2.60.0')") from None
    return ray


def _probe(address: str) -> None:
    import socket

    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=5).close()
    except (OSError, ValueError) as e:
        raise ConfigError(f"distributed_executor_backend: no Ray cluster reachable at {address!r} ({e}); start "
                          "one with `ray start --head` (and `ray start --address=HEAD:PORT` on other machines), or "
                          "set RAY_ADDRESS") from None


def _connect(ray: Any) -> bool:
    """Join the running cluster; True if this call connected (and so should disconnect)."""
    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS") or "auto"
    env = {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    for key in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VLLITE_PLATFORM"):
        if key in os.environ:
            env[key] = os.environ[key]
    if address != "auto":
        _probe(address)  # ray.init would retry an unreachable address for minutes
    try:
        ray.init(address=address, runtime_env={"env_vars": env}, logging_level=logging.WARNING,
                 log_to_driver=True)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise ConfigError(f"distributed_executor_backend: no Ray cluster reachable at {address!r} ({e}); start one "
                          "with `ray start --head` (and `ray start --address=HEAD:PORT` on other machines), or set "
                          "RAY_ADDRESS") from None
    return True


class RayExecutor(Executor):
    backend = "ray"

    def __init__(self, config: VlliteConfig, platform: Any) -> None:
        super().__init__(config, platform)
        ray = self.ray = _import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._remove_pg = remove_placement_group
        self.actors: list[Any] = []
        self.pg = None
        self.dead: WorkerDiedError | None = None
        self._owns_ray = _connect(ray)
        world = config.parallel_config.world_size
        resource = "CPU" if platform.device_type == "cpu" else "GPU"
        try:
            have = ray.cluster_resources().get(resource, 0)
            if have < world:
                raise ConfigError(f"tensor_parallel_size: {world} ranks need {world} {resource} in the Ray cluster, "
                                  f"which has {have:g} (resources: {ray.cluster_resources()})")
            self.pg = placement_group([{resource: 1}] * world, strategy="PACK")
            ready, _ = ray.wait([self.pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
            if not ready:
                raise ConfigError(f"tensor_parallel_size: the Ray cluster could not place {world} bundles of "
                                  f"{{{resource}: 1}} in {PLACEMENT_TIMEOUT_S:.0f}s (available: "
                                  f"{ray.available_resources()})")
            actor_cls = ray.remote(RayWorker)
            for rank in range(world):
                strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank)
                opts = {"num_cpus": 1} if resource == "CPU" else {"num_gpus": 1, "num_cpus": 0}
                self.actors.append(actor_cls.options(scheduling_strategy=strategy, **opts).remote())
            self.nodes = self._gather([a.node.remote() for a in self.actors])
            self._start_workers(config, platform, world)
        except BaseException:
            self.shutdown()
            raise

    def _start_workers(self, config: VlliteConfig, platform: Any, world: int) -> None:
        ips = [ip for _, ip, _ in self.nodes]
        port = self._gather([self.actors[0].free_port.remote()])[0]
        init_method = f"tcp://{ips[0]}:{port}"
        infos = []
        for rank, (_, ip, _) in enumerate(self.nodes):
            # Ranks on one host share its cores and memory; an accelerator actor sees only its own device.
            local = ips[:rank].count(ip) if platform.device_type == "cpu" else 0
            infos.append(RankInfo(rank, world, local, ips.count(ip), init_method))
        self._gather([a.init_worker.remote(config, platform, info) for a, info in zip(self.actors, infos)])
        node_ids = {nid for nid, _, _ in self.nodes}
        self.layout = {"backend": "ray", "ranks": world, "nodes": len(node_ids),
                       "processes": [f"rank {r}: Ray actor on node {nid[:12]} ({host}, {ip})"
                                     for r, (nid, ip, host) in enumerate(self.nodes)],
                       "devices": [f"{platform.device_type} (bundle {r})" for r in range(world)],
                       "dist_backend": platform.dist_backend,
                       "tensor_parallel_size": config.parallel_config.tensor_parallel_size,
                       "pipeline_parallel_size": config.parallel_config.pipeline_parallel_size}
        logger.info("ray executor: %d actors on %d node(s), %s collectives at %s", world, len(node_ids),
                    platform.dist_backend, init_method)

    def _node_of(self, rank: int) -> str:
        nodes = getattr(self, "nodes", None)
        if not nodes:
            return "(not placed yet)"
        nid, ip, host = nodes[rank]
        return f"{nid[:12]} ({host}, {ip})"

    def _gather(self, refs: list[Any]) -> list[Any]:
        """Results in rank order. A dead actor is named first: when one rank's task fails (often a peer's
        collective broken by the death), the others get a short grace to show an actor that died."""
        ray = self.ray
        index = {ref: i for i, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        task_error: tuple[int, Any] | None = None
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=None if task_error is None else DEATH_GRACE_S)
            if not done:
                break
            rank = index[done[0]]
            try:
                results[rank] = ray.get(done[0])
            except ray.exceptions.RayActorError as e:
                self._fail(rank, f"its Ray actor died: {str(e).strip().splitlines()[0]}")
            except ray.exceptions.RayTaskError as e:
                cause = getattr(e, "cause", None)
                if isinstance(cause, ConfigError):
                    self.dead = WorkerDiedError(rank, self._node_of(rank), str(cause))
                    self.shutdown()
                    raise type(cause)(f"{cause} (worker rank {rank})") from None
                task_error = task_error or (rank, e)
        if task_error is not None:
            rank, e = task_error
            cause = getattr(e, "cause", None)
            summary = f"{type(cause).__name__}: {cause}" if cause is not None else str(e).splitlines()[0]
            logger.error("worker rank %d failed:\n%s", rank, e)
            self._fail(rank, summary)
        return [results[i] for i in range(len(refs))]

    def _fail(self, rank: int, cause: str) -> None:
        self.dead = WorkerDiedError(rank, self._node_of(rank), cause)
        self.shutdown()
        raise self.dead

    def _submit(self, method: str, args: tuple) -> list[Any]:
        if self.dead is not None:
            raise self.dead
        refs = [self.ray.put(a) for a in args]  # serialised once, read by every actor
        return [actor.call.remote(method, *refs) for actor in self.actors]

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return self._gather(self._submit(method, args))

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(so).result()

    def execute_model_async(self, so: SchedulerOutput) -> StepHandle:
        """Each actor runs its calls in order, so steps sent one after another overlap across the stages."""
        return _RayStep(self, self._submit("execute_model", (so,)))

    def shutdown(self) -> None:
        ray = self.ray
        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.actors = []
        if self.pg is not None:
            try:
                self._remove_pg(self.pg)
            except Exception:  # noqa: BLE001
                pass
            self.pg = None
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False


class _RayStep:
    """A step sent to every actor: ``result()`` gathers the replies (naming a rank that failed)."""

    def __init__(self, executor: RayExecutor, refs: list[Any]) -> None:
        self.executor, self.refs = executor, refs

    def result(self) -> ModelRunnerOutput:
        return self.executor._gather(self.refs)[self.executor.output_rank]
