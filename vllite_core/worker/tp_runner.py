"""The model runner of one tensor-parallel rank.

Every rank runs the whole step (its slice of each layer, the collectives in between) and samples
from the same gathered logits, so each rank's batch state (the tokens it appends) stays the same.
Equal logits and equally seeded generators give equal samples already; broadcasting rank 0's
sampled ids makes it certain whatever a rank's generator did (only rank 0's output leaves).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vllite_core.distributed import get_tp
from vllite_core.sample.sampler import SamplerOutput
from vllite_core.worker.model_runner import ModelRunner, ModelRunnerOutput, StepInputs


class TensorParallelModelRunner(ModelRunner):
    def _sample(self, hidden: torch.Tensor, inp: StepInputs, out: ModelRunnerOutput, grammar: Any = None
                ) -> tuple[np.ndarray, SamplerOutput | None]:
        rows, sampled = super()._sample(hidden, inp, out, grammar)
        if sampled is not None:
            get_tp().communicator.broadcast(sampled.sampled_token_ids, src=0)
        return rows, sampled
