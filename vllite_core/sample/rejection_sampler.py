"""Verification of draft tokens by rejection sampling (Leviathan et al. 2023), lossless for every row.

The input is one logits row per verified position ("virtual rows"): a request with k drafts brings k + 1
rows, the last one the bonus position. Each row is processed exactly as the Sampler processes a row
(constraints, processors, penalties, temperature, top-k/top-p/min-p), with the request's output history
extended by the drafts before that position, so p is the distribution a non-speculative step would sample
from. Then, per row with a draft d:

- greedy: accept while d is the argmax of the processed logits; otherwise emit the argmax;
- random: accept with probability min(1, p(d) / q(d)) (q one-hot at d for proposers without
  probabilities, such as ngram), otherwise emit a sample of the normalised max(p - q, 0).

A bonus row emits a sample of p (the argmax for greedy rows). The caller keeps each request's accepted
prefix and the token after it. Seeded rows draw from their own generator in row order, so a seeded
request is reproducible. Only the first unaccepted row of each request draws its sample: the caller keeps
nothing after it, so a round where nothing is accepted costs one sample per request, not k + 1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllite_core.sample.metadata import SamplingMetadata
from vllite_core.sample.sampler import LogprobsTensors, Sampler, check_finite_rows, gather_logprobs
from vllite_core.sampling_params import GREEDY_EPS


@dataclass
class VerifyOutput:
    # int64 [R]: the draft where accepted, else the token emitted there; only the first unaccepted row of a
    # request is sampled (the caller keeps nothing after it), later unaccepted rows hold the argmax
    token_ids: torch.Tensor
    accepted: torch.Tensor  # bool [R]: the row's draft was accepted (always False on bonus rows)
    logprobs: LogprobsTensors | None  # of token_ids, in the sampler's logprobs mode


def _uniforms(n: int, md: SamplingMetadata, device: torch.device) -> torch.Tensor:
    """One uniform per row; seeded rows from their own generator."""
    u = torch.rand(n, device=device)
    for row, gen in md.generators.items():
        u[row] = torch.rand(1, generator=gen, device=device)[0]
    return u


def _exponentials(rows: torch.Tensor, vocab: int, md: SamplingMetadata, like: torch.Tensor) -> torch.Tensor:
    """Exp(1) draws [len(rows), vocab] for the given rows; seeded rows from their own generator."""
    e = torch.empty(len(rows), vocab, dtype=like.dtype, device=like.device)
    seeded = [(i, md.generators[r]) for i, r in enumerate(rows.tolist()) if r in md.generators]
    if len(seeded) < len(rows):
        e.exponential_()
    for i, gen in seeded:
        e[i].exponential_(generator=gen)
    return e


def _first_unaccepted(accepted: torch.Tensor, draft_ids: torch.Tensor) -> torch.Tensor:
    """Rows whose emitted token is kept: per request (rows up to and including its bonus row), the first
    row not accepted. Only these need a sample of the residual (or of p, on a bonus row)."""
    starts = torch.ones_like(accepted)
    starts[1:] = draft_ids[:-1] < 0
    rej = (~accepted).long()
    before = rej.cumsum(0) - rej  # rejections before each row, over the whole batch
    seg = starts.long().cumsum(0) - 1
    at_start = before[starts.nonzero().squeeze(1)]
    return ~accepted & (before == at_start[seg])


def rejection_sample(sampler: Sampler, logits: torch.Tensor, md: SamplingMetadata, draft_ids: torch.Tensor,
                     draft_probs: torch.Tensor | None = None) -> VerifyOutput:
    """``draft_ids`` int64 [R] (-1 on bonus rows); ``draft_probs`` [R, V] the proposer's q (None: one-hot)."""
    logits = logits.float()
    want = md.max_num_logprobs is not None
    captured = sampler.as_mode(logits) if want and sampler.logprobs_mode.startswith("raw") else None
    logits = Sampler.apply_constraints(logits, md)
    check_finite_rows(logits)
    has_draft = draft_ids >= 0
    d = draft_ids.clamp(min=0)
    argmax = logits.argmax(dim=-1)
    greedy_accept = has_draft & (d == argmax)
    if md.all_greedy:
        processed = logits
        accepted, emitted = greedy_accept, argmax
    else:
        processed = Sampler.apply_sampling_params(logits, md)
        probs = processed.softmax(dim=-1)
        p_d = probs.gather(1, d.unsqueeze(1)).squeeze(1)
        if draft_probs is None:
            q_d = torch.ones_like(p_d)
        else:
            q = torch.where(has_draft.unsqueeze(1), draft_probs.float(), 0.0)
            q_d = q.gather(1, d.unsqueeze(1)).squeeze(1)
        u = _uniforms(len(d), md, probs.device)
        random_accept = has_draft & (u * q_d < p_d)
        greedy = md.temperature < GREEDY_EPS
        accepted = torch.where(greedy, greedy_accept, random_accept)
        emitted = argmax.clone()
        # Only the first unaccepted row of each random request is kept: only those sample, by the
        # exponential race (argmax of residual / Exp(1) is a sample of residual / sum).
        rows = (_first_unaccepted(accepted, draft_ids) & ~greedy).nonzero().squeeze(1)
        if len(rows):
            if draft_probs is None:
                residual = probs[rows]
                drafted = has_draft[rows].nonzero().squeeze(1)
                residual[drafted, d[rows][drafted]] = 0.0
            else:
                residual = (probs[rows] - q[rows]).clamp(min=0.0)
            emitted[rows] = residual.div_(_exponentials(rows, probs.shape[-1], md, probs)).argmax(dim=-1)
    token_ids = torch.where(accepted, d, emitted)
    lp = None
    if want:
        if captured is None:
            if not md.all_greedy and not md.all_random:
                processed = torch.where((md.temperature < GREEDY_EPS).unsqueeze(1), logits, processed)
            captured = sampler.as_mode(processed)
        lp = gather_logprobs(captured, token_ids, md.max_num_logprobs or 0)
    return VerifyOutput(token_ids=token_ids, accepted=accepted, logprobs=lp)
