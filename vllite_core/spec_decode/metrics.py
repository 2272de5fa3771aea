"""Acceptance counters of speculative decoding (vLLM's spec_decode metrics), cumulative since start."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    num_spec_tokens: int  # k: positions counted in num_accepted_tokens_per_pos
    num_drafts: int = 0  # verification rounds (one per request and step that verified drafts)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens produced per verification round (accepted drafts + the one sampled after them)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def copy(self) -> "SpecDecodingStats":
        return SpecDecodingStats(self.num_spec_tokens, self.num_drafts, self.num_draft_tokens,
                                 self.num_accepted_tokens, list(self.num_accepted_tokens_per_pos))
