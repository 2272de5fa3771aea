"""Sliding-window cache groups end to end: blocks out of the window go back to the pool while greedy tokens
stay identical to Hugging Face; a model mixing full and sliding layers runs two cache groups side by side."""
from __future__ import annotations

import pytest
import torch
from hf_reference import hf_greedy
from tiny_models import TINY, save_tiny

from vllite_core import LLM, SamplingParams
from vllite_core.core.kv_cache_spec import SlidingWindowSpec
from vllite_core.utils import cdiv

WINDOW = 64
BS = 16
CHUNK = 64  # max_num_batched_tokens: a prefill chunk's blocks come on top of the window's


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    from transformers import MistralConfig

    path = tmp_path_factory.mktemp("mistral-swa")
    config = MistralConfig(**{**TINY, "max_position_embeddings": 1200}, sliding_window=WINDOW,
                           architectures=["MistralForCausalLM"])
    return path, save_tiny(path, config, seed=4)


def _without_window(hf):
    """A copy of the HF model attending over the whole context."""
    import copy

    full = copy.deepcopy(hf)
    full.config.sliding_window = None
    for layer in full.model.layers:
        layer.self_attn.sliding_window = None
    return full


def _held_blocks(llm) -> list[int]:
    """Real (non-null) blocks each running request holds in each cache group."""
    sched = llm.llm_engine.core.engine_core.scheduler
    return [sum(not b.is_null for b in blocks) for r in sched.running for blocks in r.kv_blocks]


def test_sliding_window_blocks_stay_bounded_and_tokens_match_hf(mistral):
    path, hf = mistral
    prompt = torch.randint(0, 512, (900,), generator=torch.Generator().manual_seed(5)).tolist()
    n_out = 100
    ref = hf_greedy(hf, prompt, n_out)
    assert hf_greedy(_without_window(hf), prompt, 8) != ref[:8]  # the window changes the tokens here
    llm = LLM(model=str(path), dtype="float32", block_size=BS, max_num_batched_tokens=CHUNK, num_kv_blocks=128)
    groups = llm.llm_engine.core.engine_core.kv_cache_manager.groups
    assert [type(g.spec) for g in groups] == [SlidingWindowSpec]
    engine = llm.llm_engine
    engine.add_request("r", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True))
    peak, tokens = 0, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
        peak = max([peak] + _held_blocks(llm))
    assert tokens == ref
    # The window's blocks, the partly filled block at its start, and one prefill chunk's blocks.
    bound = cdiv(WINDOW - 1 + CHUNK, BS) + 1
    full = cdiv(len(prompt) + n_out, BS)  # what a full-attention cache holds for the same context
    assert 0 < peak <= bound < full
    print(f"sliding window {WINDOW}, {len(prompt) + n_out} tokens: peak {peak} blocks held vs {full} for full "
          "attention")
    # Every block is back, and a second request with the same prompt hits the prefix cache.
    kv = engine.core.engine_core.kv_cache_manager
    assert kv.get_num_free_blocks() == kv.num_usable_blocks
    again = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=8,
                                                                         ignore_eos=True))[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == ref[:8]


def test_full_and_sliding_layers_run_as_two_groups(tmp_path):
    from transformers import Qwen2Config

    config = Qwen2Config(**TINY, architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=24,
                         max_window_layers=1, tie_word_embeddings=False)
    hf = save_tiny(tmp_path, config, seed=2)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (5, 40, 90)]
    ref = [hf_greedy(hf, p, 30) for p in prompts]
    llm = LLM(model=str(tmp_path), dtype="float32", block_size=4, max_num_batched_tokens=32, num_kv_blocks=200)
    runner = llm.llm_engine.core.engine_core.worker.runner
    assert [g.spec.kind for g in runner.kv_cache_groups] == ["full_attention", "sliding_window"]
    # Layer 0 (full) and layer 1 (sliding) are position 0 of their groups: one tensor serves both.
    assert runner.kv_caches[0] is runner.kv_caches[1]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == ref
    kv = llm.llm_engine.core.engine_core.kv_cache_manager
    assert kv.get_num_free_blocks() == kv.num_usable_blocks
