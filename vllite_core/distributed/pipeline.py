"""Pipeline parallelism: which layers each stage owns, and the stage-to-stage transfers.

The split is vLLM's (``get_pp_indices``): ``num_layers // pp`` layers per stage, the remainder one
each to the stages just before the last, counting backwards (the last stage also runs the final
norm and the LM head, the first the embedding). A stage with no layer is refused.

Activations go from a rank to the rank of the next stage with the same tensor-parallel rank, with
torch.distributed point-to-point calls on the executor's process group (global rank =
stage * tensor_parallel_size + tensor-parallel rank).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllite_core.errors import ConfigError


def stage_layer_counts(num_layers: int, pp_size: int) -> list[int]:
    """Layers of each stage, first to last; ConfigError naming ``pipeline_parallel_size`` if a stage gets none."""
    if num_layers < pp_size:
        raise ConfigError(f"pipeline_parallel_size: {pp_size} stages for a model of {num_layers} layer(s) leaves "
                          f"a stage without layers; use at most {num_layers} stages")
    counts = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        counts[-i] += 1
    return counts


def stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """``[start, end)`` of the layers stage ``pp_rank`` owns."""
    counts = stage_layer_counts(num_layers, pp_size)
    start = sum(counts[:pp_rank])
    return start, start + counts[pp_rank]


@dataclass(frozen=True)
class IntermediateTensors:
    """What one stage hands the next: the layer output and the residual stream (their sum is the stream), or
    for a model whose layers add their own residual (``residual`` None) the stream alone."""

    hidden_states: torch.Tensor
    residual: torch.Tensor | None


class PipelineChannel:
    """Point-to-point transfers between this rank and its neighbours in the pipeline (global ranks)."""

    def __init__(self, rank: int, tp_size: int, pp_rank: int, pp_size: int) -> None:
        self.pp_rank, self.pp_size = pp_rank, pp_size
        self.next_rank = rank + tp_size if pp_rank + 1 < pp_size else None
        self.prev_rank = rank - tp_size if pp_rank > 0 else None

    @property
    def is_first(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def send(self, t: IntermediateTensors) -> None:
        import torch.distributed as dist

        assert self.next_rank is not None
        dist.send(t.hidden_states.contiguous(), self.next_rank)
        if t.residual is not None:
            dist.send(t.residual.contiguous(), self.next_rank)

    def recv(self, num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device,
             residual: bool = True) -> IntermediateTensors:
        """The previous stage's tensors; ``residual``: whether the model sends a residual stream."""
        import torch.distributed as dist

        assert self.prev_rank is not None
        h = torch.empty(num_tokens, hidden_size, dtype=dtype, device=device)
        dist.recv(h, self.prev_rank)
        if not residual:
            return IntermediateTensors(h, None)
        r = torch.empty_like(h)
        dist.recv(r, self.prev_rank)
        return IntermediateTensors(h, r)
