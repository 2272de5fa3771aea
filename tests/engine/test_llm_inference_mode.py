"""An engine built and run inside the caller's ``torch.inference_mode()`` (common in notebooks and eval
scripts) works as one built outside it: its weights and caches must not become inference tensors."""
from __future__ import annotations

import torch
from hf_reference import hf_greedy

from vllite_core import LLM, SamplingParams

PROMPT = [1, 17, 42, 99, 7, 250, 31]


def test_engine_built_under_inference_mode_matches_hf(tiny_path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    ref = hf_greedy(hf, PROMPT, 8)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with torch.inference_mode():
        llm = LLM(tiny_path, dtype="float32", max_model_len=128)
        inside = llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0].token_ids
    outside = llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0].token_ids
    assert inside == outside == ref
    weight = next(llm.llm_engine.core.engine_core.worker.runner.model.parameters())
    assert not weight.is_inference()
