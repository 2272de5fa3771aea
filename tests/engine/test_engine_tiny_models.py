"""The engine (scheduler, paged cache, runner, sampler) on tiny random Qwen2 and rope-scaled Llama
checkpoints: greedy tokens identical to Hugging Face, in one mixed batch."""
from __future__ import annotations

import pytest
import torch
from hf_reference import hf_greedy
from tiny_models import TINY, save_tiny

from vllite_core import LLM, SamplingParams


def _configs():
    from transformers import LlamaConfig, Qwen2Config

    return {
        "qwen2-gqa-bias": Qwen2Config(**TINY, architectures=["Qwen2ForCausalLM"], tie_word_embeddings=False),
        "llama-rope-llama3": LlamaConfig(**TINY, architectures=["LlamaForCausalLM"], rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
        "llama-rope-yarn": LlamaConfig(**TINY, architectures=["LlamaForCausalLM"], rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}),
    }


@pytest.mark.parametrize("name", ["qwen2-gqa-bias", "llama-rope-llama3", "llama-rope-yarn"])
def test_tiny_model_greedy_matches_hf(tmp_path, name):
    hf = save_tiny(tmp_path, _configs()[name])
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (3, 17, 40, 90)]
    ref = [hf_greedy(hf, p, 24) for p in prompts]
    # A small budget forces chunked prefill beside decodes; block_size 16 splits prompts across blocks.
    llm = LLM(model=str(tmp_path), dtype="float32", max_num_batched_tokens=32, num_kv_blocks=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == ref
