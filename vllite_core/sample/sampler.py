"""Batched sampling with vLLM V1's logprobs semantics.

Order: raw logits -> (raw logprobs/logits captured) -> temperature -> top-k ->
top-p -> min-p -> (processed logprobs/logits captured) -> sample. Greedy rows take
the argmax of the raw logits. Random rows use the exponential-race trick
(argmax of p / q with q ~ Exp(1)), which lets a seeded row draw from its own
generator while the rest of the batch shares one draw.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllite_core.sample.metadata import SamplingMetadata


@dataclass
class LogprobsTensors:
    """Top-k logprob values per row; column 0 is the sampled token."""

    token_ids: torch.Tensor  # int64 [N, 1 + k]
    values: torch.Tensor  # float32 [N, 1 + k]
    sampled_ranks: torch.Tensor  # int64 [N], 1-based rank of the sampled token


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # int64 [N]
    logprobs: LogprobsTensors | None


class Sampler:
    def __init__(self, logprobs_mode: str = "raw_logprobs") -> None:
        self.logprobs_mode = logprobs_mode

    def forward(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        want = md.max_num_logprobs is not None
        captured = None
        if want and self.logprobs_mode.startswith("raw"):
            captured = self._as_mode(logits)
        greedy = logits.argmax(dim=-1) if not md.all_random else None
        if md.all_greedy:
            if want and captured is None:  # processed == raw for greedy rows
                captured = self._as_mode(logits)
            sampled = greedy
        else:
            processed = self.process(logits, md)
            if want and captured is None:
                captured = self._as_mode(processed)
            sampled = self._random_sample(processed, md)
            if greedy is not None:
                sampled = torch.where(md.temperature < 1e-5, greedy, sampled)
        lp = self._gather_logprobs(captured, sampled, md.max_num_logprobs) if want else None
        return SamplerOutput(sampled_token_ids=sampled, logprobs=lp)

    def _as_mode(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.log_softmax(dim=-1) if self.logprobs_mode.endswith("logprobs") else logits.clone()

    @staticmethod
    def process(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p on a batch; masked entries become -inf."""
        temp = torch.where(md.temperature < 1e-5, torch.ones_like(md.temperature), md.temperature)
        logits = logits / temp.unsqueeze(1)
        if md.top_k is not None or md.top_p is not None:
            logits = _apply_top_k_top_p(logits, md.top_k, md.top_p)
        if md.min_p is not None:
            probs = logits.softmax(dim=-1)
            thresh = probs.amax(dim=-1, keepdim=True) * md.min_p.unsqueeze(1)
            logits = logits.masked_fill(probs < thresh, float("-inf"))
        return logits

    @staticmethod
    def _random_sample(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        probs = logits.softmax(dim=-1)
        q = torch.empty_like(probs)
        if len(md.generators) < probs.shape[0]:
            q.exponential_()
        for row, gen in md.generators.items():
            q[row].exponential_(generator=gen)
        return probs.div_(q).argmax(dim=-1)

    @staticmethod
    def _gather_logprobs(values: torch.Tensor, sampled: torch.Tensor, k: int | None) -> LogprobsTensors:
        k = k or 0
        sampled_vals = values.gather(1, sampled.unsqueeze(1))
        ranks = (values > sampled_vals).sum(dim=-1) + 1
        if k > 0:
            top_vals, top_ids = values.topk(k, dim=-1)
            ids = torch.cat([sampled.unsqueeze(1), top_ids], dim=1)
            vals = torch.cat([sampled_vals, top_vals], dim=1)
        else:
            ids, vals = sampled.unsqueeze(1), sampled_vals
        return LogprobsTensors(token_ids=ids, values=vals, sampled_ranks=ranks)


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask outside top-k and the top-p nucleus, with one sort for the whole batch."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        # Keep the last k (largest) entries of each ascending row.
        kth = (vocab - top_k.clamp(1, vocab)).unsqueeze(1)
        kth_val = sorted_logits.gather(1, kth)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_val, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        cum = probs.cumsum(dim=-1)
        drop = cum <= (1 - top_p).unsqueeze(1)
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
