"""The engine on this platform: greedy tokens identical with and without graphs, and to Hugging Face."""
from __future__ import annotations

import gc

import pytest
import torch

from vllite_core.conformance.kit import hf_greedy, save_tiny_llama

from .conftest import dtype_name

MAX_TOKENS = 20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    hf = save_tiny_llama(str(path), seed=1)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 500, (n,), generator=gen).tolist() for n in (3, 18, 41, 70)]
    return str(path), hf, prompts


def _generate(path, platform_name, dtype, prompts, enforce_eager):
    from vllite_core import LLM, SamplingParams

    # A small token budget makes prompts prefill in chunks beside other requests' decodes.
    llm = LLM(model=path, device=platform_name, dtype=dtype_name(dtype), enforce_eager=enforce_eager,
              max_num_batched_tokens=32, num_kv_blocks=96, seed=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    del llm, outs
    gc.collect()
    return tokens


def test_greedy_eager_equals_graphs_equals_hf(tiny, platform_name, platform, model_dtype):
    path, hf, prompts = tiny
    eager = _generate(path, platform_name, model_dtype, prompts, enforce_eager=True)
    graphs = _generate(path, platform_name, model_dtype, prompts, enforce_eager=False)
    assert graphs == eager, "greedy tokens differ between enforce_eager=True and False"
    assert all(len(t) == MAX_TOKENS for t in eager)
    if model_dtype != torch.float32:
        pytest.skip(f"the model ran in {dtype_name(model_dtype)}: not held to Hugging Face's float32 tokens")
    ref = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    assert eager == ref, "greedy tokens differ from Hugging Face transformers"
