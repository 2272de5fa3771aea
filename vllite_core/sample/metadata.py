"""Per-step sampling parameters as tensors, so the sampler never loops over the vocabulary."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
    # Applied before temperature, to greedy rows too (None: no row uses it).
    # Structured output, first of all: rows (int64 [M]) and their packed allowed-token masks (int32 [M, V/32]).
    grammar_rows: torch.Tensor | None = None
    grammar_bitmask: torch.Tensor | None = None
    allowed_mask: torch.Tensor | None = None  # bool [N, V], True where a token may be generated
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) set to -inf
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (rows, token ids, values) added
    presence: torch.Tensor | None = None  # float32 [N]
    frequency: torch.Tensor | None = None  # float32 [N]
    repetition: torch.Tensor | None = None  # float32 [N]
    output_counts: torch.Tensor | None = None  # float32 [N, V]: occurrences in the generated tokens
    seen_mask: torch.Tensor | None = None  # bool [N, V]: in the prompt or the generated tokens
    processors: list[Any] = field(default_factory=list)  # global LogitsProcessors
    batch_info: Any = None  # BatchInfo for the processors

    @property
    def constrained(self) -> bool:
        """Whether anything of ``Sampler.apply_constraints`` applies to some row (every field it reads)."""
        return bool(self.processors) or any(f is not None for f in (
            self.grammar_bitmask, self.allowed_mask, self.banned, self.bias, self.presence, self.frequency,
            self.repetition, self.output_counts, self.seen_mask))
