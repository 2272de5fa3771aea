"""A decoder stack split over pipeline stages: each rank builds only its stage's layers.

``StageLayers`` holds the layer range of this rank's stage (``vllite_core.distributed.pipeline``) and a
``ModuleList`` of every layer index in which the layers of other stages are ``MissingLayer``
placeholders without parameters, so parameter names keep their checkpoint indices
(``model.layers.7.mlp...``) and a checkpoint tensor of another stage's layer is recognised and skipped
without being read.
"""
from __future__ import annotations

import re
from collections.abc import Callable

from torch import nn

from vllite_core.distributed import get_tp
from vllite_core.distributed.pipeline import stage_layers


class MissingLayer(nn.Module):
    """Where another stage's layer sits: no parameters, never called."""

    def forward(self, *args: object) -> None:
        raise RuntimeError("a layer of another pipeline stage was called")


class StageLayers:
    """This rank's stage: its layers ``[start, end)``, whether it embeds (first) and normalises and projects to
    the vocabulary (last)."""

    def __init__(self, num_layers: int) -> None:
        tp = get_tp()
        self.pp_rank, self.pp_size = tp.pp_rank, tp.pp_size
        self.start, self.end = stage_layers(num_layers, tp.pp_rank, tp.pp_size)
        self.is_first, self.is_last = tp.is_first_stage, tp.is_last_stage

    @property
    def is_whole(self) -> bool:
        return self.pp_size == 1

    def build(self, num_layers: int, make: Callable[[int], nn.Module]) -> nn.ModuleList:
        """Every index: ``make(i)`` for this stage's layers, a ``MissingLayer`` for the others'."""
        return nn.ModuleList(make(i) if self.start <= i < self.end else MissingLayer() for i in range(num_layers))

    def owns_weight(self, name: str) -> bool:
        """Whether a checkpoint tensor (engine name) belongs on this stage: another stage's layer does not, nor
        the embedding off the first stage (its table is also the head on a tied last stage: the model renames
        it there), nor the final norm and the head off the last."""
        m = _LAYER_INDEX.search(name)
        if m is not None:
            return self.start <= int(m.group(1)) < self.end
        if name.startswith("model.embed_tokens."):
            return self.is_first
        if name.startswith(("model.norm.", "lm_head.")):
            return self.is_last
        return True

    def weight_name(self, name: str, tied: bool) -> str | None:
        """A checkpoint tensor's engine name on this stage, or None where another stage holds it; with a tied
        head, the last stage (when it is not also the first) loads the embedding's table as its head."""
        if self.is_whole:
            return name
        if tied and name == "model.embed_tokens.weight" and self.is_last:
            return name if self.is_first else "lm_head.weight"
        return name if self.owns_weight(name) else None


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")
