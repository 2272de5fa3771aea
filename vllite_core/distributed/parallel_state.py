"""This process's place in the tensor-parallel group and the pipeline; models read it while they are built.

The executor starts one worker per rank and each calls ``init_tensor_parallel`` before the model is
built. A process that never calls it (the in-process ``uni`` executor, a model built by hand in a
test) is rank 0 of 1 and its collectives are no-ops. With pipeline parallelism the world is
``pipeline_parallel_size`` stages of ``tensor_parallel_size`` ranks: ``rank``/``world_size`` here are the
rank within its stage's tensor-parallel group (what layers shard by), ``pp_rank``/``pp_size`` its stage.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

from vllite_core.distributed.communicator import Communicator, SingleRankCommunicator


@dataclass
class TensorParallelState:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0  # index of this rank's device on its node
    local_world_size: int = 1  # ranks on this node (they share its cores / host memory)
    communicator: Communicator = field(default_factory=SingleRankCommunicator)
    pp_rank: int = 0  # this rank's pipeline stage
    pp_size: int = 1
    global_rank: int = 0  # pp_rank * world_size + rank
    # ParallelConfig.enable_expert_parallel: a FusedMoE holds whole experts (this rank's share), not slices.
    enable_expert_parallel: bool = False

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


_state = TensorParallelState()


def get_tp() -> TensorParallelState:
    return _state


def init_tensor_parallel(rank: int, world_size: int, local_rank: int, local_world_size: int, init_method: str,
                         platform: Any, timeout_s: float = 600.0, pipeline_parallel_size: int = 1,
                         enable_expert_parallel: bool = False) -> TensorParallelState:
    """Join the process group (the platform's ``dist_backend``) and make this rank's communicator: over every
    rank, or with several pipeline stages over its stage's ranks (every rank makes every stage's group, as
    torch.distributed requires)."""
    global _state
    tp = world_size // pipeline_parallel_size
    pp_rank, tp_rank = divmod(rank, tp)
    if world_size > 1:
        import torch.distributed as dist

        dist.init_process_group(backend=platform.dist_backend, init_method=init_method, rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
        if pipeline_parallel_size == 1:
            comm = platform.make_communicator(None)
        else:
            groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(pipeline_parallel_size)]
            comm = platform.make_communicator(groups[pp_rank]) if tp > 1 else SingleRankCommunicator()
    else:
        comm = SingleRankCommunicator()
    _state = TensorParallelState(tp_rank, tp, local_rank, local_world_size, comm, pp_rank, pipeline_parallel_size,
                                 rank, enable_expert_parallel)
    return _state


def destroy_tensor_parallel() -> None:
    global _state
    if _state.world_size * _state.pp_size > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    _state = TensorParallelState()
