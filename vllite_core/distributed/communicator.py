"""Collectives of the tensor-parallel group, behind one small class a platform may replace.

Models call these three operations and nothing else of torch.distributed, so a platform whose
library does better than the process group's backend (a custom all-reduce, a fused kernel)
returns a subclass from ``Platform.make_communicator``.
"""
from __future__ import annotations

from typing import Any

import torch


class Communicator:
    """torch.distributed collectives over ``group`` (None: the default group, every rank)."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks, written into ``x`` and returned."""
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` (equal shapes) concatenated along ``dim`` in rank order."""
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``x`` of rank ``src`` (counted in this group) on every rank (in place)."""
        import torch.distributed as dist

        dist.broadcast(x, src if self.group is None else dist.get_global_rank(self.group, src), group=self.group)
        return x


class SingleRankCommunicator(Communicator):
    """One rank: every collective is the identity (no process group needed)."""

    def __init__(self) -> None:
        self.group = None
        self.world_size = 1
        self.rank = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return x

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        return x
