"""This process's place in the tensor-parallel group; models read it while they are built.

The executor starts one worker per rank and each calls ``init_tensor_parallel`` before the model is
built. A process that never calls it (the in-process ``uni`` executor, a model built by hand in a
test) is rank 0 of 1 and its collectives are no-ops.
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
    # ParallelConfig.enable_expert_parallel: a FusedMoE holds whole experts (this rank's share), not slices.
    enable_expert_parallel: bool = False


_state = TensorParallelState()


def get_tp() -> TensorParallelState:
    return _state


def init_tensor_parallel(rank: int, world_size: int, local_rank: int, local_world_size: int, init_method: str,
                         platform: Any, timeout_s: float = 600.0,
                         enable_expert_parallel: bool = False) -> TensorParallelState:
    """Join the process group (the platform's ``dist_backend``) and make this rank's communicator."""
    global _state
    if world_size > 1:
        import torch.distributed as dist

        dist.init_process_group(backend=platform.dist_backend, init_method=init_method, rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
        comm = platform.make_communicator(None)
    else:
        comm = SingleRankCommunicator()
    _state = TensorParallelState(rank, world_size, local_rank, local_world_size, comm, enable_expert_parallel)
    return _state


def destroy_tensor_parallel() -> None:
    global _state
    if _state.world_size > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    _state = TensorParallelState()
