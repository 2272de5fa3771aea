"""SmolLM2-135M (fp32) with a random PEFT adapter: greedy identical to peft on HF, offline and through chat."""
from __future__ import annotations

import pytest
from hf_reference import hf_greedy
from lora_fixtures import make_adapter

from vllite_core import LLM, LoRARequest, SamplingParams

NEW = 10
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapter(smollm2_hf, tmp_path_factory):
    path = tmp_path_factory.mktemp("smollm2-lora")
    peft = make_adapter(smollm2_hf, path, seed=7, scale=0.5, r=8, lora_alpha=16, target_modules=TARGETS)
    return peft, LoRARequest("smol-lora", 1, str(path))


@pytest.mark.slow
def test_smollm2_adapter_greedy_matches_peft(smollm2_hf, adapter):
    peft, req = adapter
    llm = LLM(dtype="float32", max_model_len=512, enable_lora=True, max_lora_rank=8)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(t) for t in ("The capital of France is", "def fibonacci(n):")]
    base_ref = [hf_greedy(smollm2_hf, p, NEW) for p in prompts]
    lora_ref = [hf_greedy(peft, p, NEW) for p in prompts]
    assert lora_ref != base_ref  # the adapter changes the output
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts * 2], sp, lora_request=[req, req, None, None])
    assert [o.outputs[0].token_ids for o in outs] == lora_ref + base_ref
    conv = [{"role": "user", "content": "Name a colour."}]
    ids = tok.encode(tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True))
    chat = llm.chat(conv, sp, lora_request=req)
    assert chat[0].outputs[0].token_ids == hf_greedy(peft, ids, NEW)


def _agreed(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.slow
def test_gguf_blocks_take_the_same_adapter(smollm2_hf, adapter):
    """quantization="gguf" keeps the linear weights as blocks; the adapter's slots are sized by the layers'
    widths (not the blocks' shape) and its delta applies on top: output follows peft's, not the base's."""
    peft, req = adapter
    llm = LLM(dtype="float32", max_model_len=512, enable_lora=True, max_lora_rank=8, quantization="gguf")
    tok = llm.get_tokenizer()
    prompts = [tok.encode(t) for t in ("The capital of France is", "def fibonacci(n):")]
    lora_ref = [hf_greedy(peft, p, NEW) for p in prompts]
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts * 2], sp, lora_request=[req, req, None, None])
    got = [o.outputs[0].token_ids for o in outs]
    assert got[:2] != got[2:]
    assert all(_agreed(g, r) >= 4 for g, r in zip(got[:2], lora_ref))
