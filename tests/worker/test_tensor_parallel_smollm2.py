"""Tensor parallelism on the real SmolLM2-135M (fp32): two ranks in two processes (mp executor, gloo)
give the greedy tokens of one rank and of Hugging Face transformers, through chunked prefill, prefix
caching and preemption, with logprobs within 1e-4 of both.

SmolLM2 has 9 query heads over 3 KV heads: rank 0 holds 2 KV-head groups (6 heads), rank 1 one (3)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_reference import hf_greedy, hf_logits

from vllite_core import LLM, SamplingParams

pytestmark = pytest.mark.slow

NEW_TOKENS = 12
# Chunked prefill (a 64-token budget splits every prompt), prefix caching (a shared 48-token prefix),
# and a cache of 18 blocks that cannot hold the three later requests at once (preemption).
ENGINE = dict(dtype="float32", max_model_len=256, max_num_batched_tokens=64, num_kv_blocks=18,
              enable_prefix_caching=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def prompts():
    rs = np.random.RandomState(3)
    prefix = rs.randint(17, 49152, size=48).tolist()
    return [prefix + rs.randint(17, 49152, size=n).tolist() for n in (30, 90, 75, 100)]


def _run(llm: LLM, prompts):
    """The first prompt alone (its prefix blocks get cached), then the others together."""
    first = llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY)
    return first + llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], GREEDY)


@pytest.fixture(scope="module")
def tp1(prompts):
    llm = LLM(tensor_parallel_size=1, **ENGINE)
    outs = _run(llm, prompts)
    stats = llm.llm_engine.core.stats()
    llm.llm_engine.core.shutdown()
    return outs, stats


@pytest.fixture(scope="module")
def tp2(prompts):
    llm = LLM(tensor_parallel_size=2, distributed_executor_backend="mp", **ENGINE)
    assert llm.llm_engine.core.engine_core.executor.layout["ranks"] == 2
    outs = _run(llm, prompts)
    stats = llm.llm_engine.core.stats()
    llm.llm_engine.core.shutdown()
    return outs, stats


@pytest.fixture(scope="module")
def reference(smollm2_hf, prompts):
    return [hf_greedy(smollm2_hf, p, NEW_TOKENS) for p in prompts]


def test_tp2_tokens_match_tp1_and_hf(tp1, tp2, reference):
    tokens1 = [o.outputs[0].token_ids for o in tp1[0]]
    tokens2 = [o.outputs[0].token_ids for o in tp2[0]]
    assert tokens2 == reference
    assert tokens2 == tokens1


def test_tp2_exercised_chunking_prefix_cache_and_preemption(tp2, prompts):
    outs, stats = tp2
    assert all(len(p) > ENGINE["max_num_batched_tokens"] for p in prompts[1:])  # every later prompt is chunked
    assert stats.num_preemptions_total > 0
    assert all(o.num_cached_tokens >= 48 for o in outs[1:2])  # the first of the later ones reuses the prefix
    assert stats.prefix_cache_hits > 0


def _logprobs(out):
    """The sampled token's logprob at each step, and the top-2 {token: logprob} of each step."""
    comp = out.outputs[0]
    return ([lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids)],
            [{t: v.logprob for t, v in lp.items()} for lp in comp.logprobs])


def test_tp2_logprobs_match_tp1_and_hf(tp1, tp2, prompts, smollm2_hf):
    for o1, o2, prompt in zip(tp1[0], tp2[0], prompts):
        sampled1, top1 = _logprobs(o1)
        sampled2, top2 = _logprobs(o2)
        np.testing.assert_allclose(sampled2, sampled1, atol=1e-4)
        for a, b in zip(top1, top2):
            assert a.keys() == b.keys()
            np.testing.assert_allclose([b[t] for t in a], list(a.values()), atol=1e-4)
        tokens = o2.outputs[0].token_ids
        logits = hf_logits(smollm2_hf, prompt + tokens[:-1])[len(prompt) - 1:]
        ref = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
        np.testing.assert_allclose(sampled2, ref.numpy(), atol=1e-4)
