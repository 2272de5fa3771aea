"""The model runner of one tensor-parallel rank.

Every rank runs the whole step (its slice of each layer, the collectives in between) and samples
from the same gathered logits, so each rank's batch state (the tokens it appends) stays the same.
Equal logits and equally seeded generators give equal samples already; broadcasting rank 0's
sampled ids (and, with speculative decoding, its verified tokens and acceptances) makes it certain
whatever a rank's generator did (only rank 0's output leaves).
"""
from __future__ import annotations

import torch

from vllite_core.distributed import get_tp
from vllite_core.worker.model_runner import ModelRunner


class TensorParallelModelRunner(ModelRunner):
    def share_sampled(self, *tensors: torch.Tensor) -> None:
        """Rank 0's sampled ids and verification results, in place on every rank (only rank 0's output leaves,
        but every rank appends the same tokens to its batch state)."""
        for t in tensors:
            get_tp().communicator.broadcast(t, src=0)
