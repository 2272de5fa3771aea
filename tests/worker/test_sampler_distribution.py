"""The batched sampler draws from the distribution top-k / top-p / min-p define (20k samples)."""
from __future__ import annotations

import pytest
import torch

from vllite_core.sample.metadata import SamplingMetadata
from vllite_core.sample.sampler import Sampler

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def expected(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    p = torch.softmax(LOGITS / temperature, -1)
    keep = torch.ones_like(p, dtype=torch.bool)
    order = torch.argsort(p, descending=True)
    if top_k:
        keep[order[top_k:]] = False
        # top-p then works on the top-k distribution, renormalised (as HF's and vLLM's samplers do).
        p = torch.where(keep, p, torch.zeros_like(p))
        p = p / p.sum()
    if top_p < 1.0:
        cum = 0.0
        for rank, idx in enumerate(order.tolist()):
            if rank and cum >= top_p:
                keep[idx] = False
            cum += float(p[idx])
    if min_p:
        keep &= p >= min_p * p.max()
    q = torch.where(keep, p, torch.zeros_like(p))
    return q / q.sum()


@pytest.mark.parametrize("kw", [{}, {"temperature": 0.5}, {"top_k": 3}, {"top_p": 0.8}, {"min_p": 0.2},
                                {"top_k": 5, "top_p": 0.9, "temperature": 1.3}])
def test_sample_distribution(kw):
    n = 20_000
    torch.manual_seed(0)
    md = SamplingMetadata(
        temperature=torch.full((n,), kw.get("temperature", 1.0)),
        top_k=torch.full((n,), kw["top_k"], dtype=torch.long) if "top_k" in kw else None,
        top_p=torch.full((n,), kw["top_p"]) if "top_p" in kw else None,
        min_p=torch.full((n,), kw["min_p"]) if "min_p" in kw else None,
        all_greedy=False, all_random=True, generators={}, max_num_logprobs=None)
    out = Sampler().forward(LOGITS.repeat(n, 1), md).sampled_token_ids
    freq = torch.bincount(out, minlength=len(LOGITS)).float() / n
    want = expected(**kw)
    assert float((freq - want).abs().sum()) / 2 < 0.015  # total variation
    assert bool((freq[want == 0] == 0).all())  # nothing outside the allowed set
