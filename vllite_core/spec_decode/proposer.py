"""What a speculative-decoding proposer is to the model runner: one closed interface.

Every proposer subclasses ``Proposer``; each hook has a no-op default, so the runner calls them all
without asking what a proposer can do. A history proposer (ngram, a plugin's) overrides ``propose``;
a proposer with a model of its own (``model_proposer.py``) overrides the set-up hooks and
``propose_step``. A plugin's factory may return any object with ``propose``: the runner wraps it
(``as_proposer``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

if TYPE_CHECKING:
    from vllite_core.worker.model_runner import ModelRunner, StepInputs


class Proposer:
    num_speculative_tokens: int
    # The scheduler holds num_speculative_tokens slots past each step (a proposer writing KV of its drafts).
    needs_lookahead: ClassVar[bool] = False
    # Runs in every step with scheduled tokens, not only when a row sampled (a model catching up on prompts).
    runs_every_step: ClassVar[bool] = False

    @classmethod
    def check_config(cls, spec_config: Any, target_hf_config: Any) -> None:
        """At engine start, before the target loads (a draft model: it exists, it shares the vocabulary)."""

    def load_model(self, runner: ModelRunner) -> None:
        """Load a model of the proposer's own beside the runner's."""

    def kv_bytes_per_block(self) -> int:
        """Memory one block id costs in the proposer's own cache tensors."""
        return 0

    def initialize_kv_cache(self, runner: ModelRunner, num_blocks: int) -> None:
        """The proposer's pages of the same block ids as the target's."""

    def release_kv_cache(self) -> None:
        """Drop those pages (sleep mode)."""

    def propose(self, token_ids: np.ndarray, num_tokens: np.ndarray) -> list[list[int]]:
        """``token_ids`` [B, L] int64, row i valid up to ``num_tokens[i]`` (prompt + accepted outputs).
        Returns up to ``num_speculative_tokens`` drafts per row (an empty list: no guess)."""
        return [[] for _ in range(len(num_tokens))]

    def propose_step(self, runner: ModelRunner, inp: StepInputs, hidden: torch.Tensor, sampled_rows: np.ndarray
                     ) -> dict[str, list[int]]:
        """The drafts of the requests in ``sampled_rows`` (the batch rows that got tokens this step), by request
        id: from each row's history (``propose``) unless the proposer runs a model on the step."""
        if len(sampled_rows) == 0:
            return {}
        b = runner.batch
        num_tokens = b.num_tokens[sampled_rows]
        drafts = self.propose(b.token_ids[sampled_rows, :int(num_tokens.max())], num_tokens)
        return {b.states[r].req_id: d for r, d in zip(sampled_rows.tolist(), drafts) if d}  # type: ignore[union-attr]


class PluginProposer(Proposer):
    """A plugin's object with ``propose(token_ids, num_tokens)`` (docs/plugins.md), as a Proposer."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.num_speculative_tokens = int(inner.num_speculative_tokens)

    def propose(self, token_ids: np.ndarray, num_tokens: np.ndarray) -> list[list[int]]:
        return self.inner.propose(token_ids, num_tokens)


def as_proposer(made: Any) -> Proposer:
    return made if isinstance(made, Proposer) else PluginProposer(made)
