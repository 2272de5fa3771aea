"""Per-step sampling parameters as tensors, so the sampler never loops over the vocabulary."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # float32 [N]; 0 for greedy rows
    top_k: torch.Tensor | None  # int64 [N] (vocab size where disabled), None if no row uses it
    top_p: torch.Tensor | None  # float32 [N], None if no row uses it
    min_p: torch.Tensor | None  # float32 [N], None if no row uses it
    all_greedy: bool
    all_random: bool
    generators: dict[int, torch.Generator]  # row -> generator for seeded rows
    max_num_logprobs: int | None  # top-k logprobs wanted by some row (None: no row wants logprobs)
