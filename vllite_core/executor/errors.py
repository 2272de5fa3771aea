"""The error an executor raises when a worker rank is lost."""
from __future__ import annotations

from vllite_core.errors import EngineDeadError


class WorkerDiedError(EngineDeadError):
    """A worker rank died or failed: the engine cannot step any more (its other ranks are stopped)."""

    def __init__(self, rank: int, node: str, cause: str) -> None:
        super().__init__(f"worker rank {rank} on node {node} failed: {cause}")
        self.rank = rank
        self.node = node
        self.cause = cause
