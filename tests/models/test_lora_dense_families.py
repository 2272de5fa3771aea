"""LoRA and two tensor-parallel ranks for every dense family (model_registry/models/dense.py), against HF and peft.

Per family (tests/dense_family_configs.py), computed once per module: a tiny random checkpoint; a peft adapter
(``init_lora_weights=False``: random, non-zero B) on every linear projection of its decoder layers by the
family's own names (Phi-3's stacked ``qkv_proj`` and ``gate_up_proj``, GLM-4's ``gate_up_proj``); HF
``generate``'s greedy tokens and raw logits for the base model and peft's for the adapter.

One engine per family and rank count serves, in one batch, the base model and the adapter on the same prompt
(the prefix cache keeps them apart) and the adapter on a prompt sharing a 20-token prefix, with chunked prefill
(a 16-token budget under prompts of 26 and 37 tokens) and block size 4: tokens identical, logprobs within 1e-4,
float32. With one rank here; with ``tensor_parallel_size=2`` (the mp executor: each rank its shard of the
model and of the adapter) in the slow test, for the families that shard differently from Llama.
"""
from __future__ import annotations

import pytest
import torch
from dense_family_configs import ARCH, family_config
from lora_fixtures import make_adapter
from tiny_models import save_tiny

torch.set_num_threads(2)

MAX_TOKENS = 8


class Case:
    def __init__(self, name, path, targets, requests, refs):
        self.name, self.path, self.targets = name, path, targets
        self.requests = requests  # [(prompt, adapter or None)]
        self.refs = refs  # per request: (tokens, logits [steps, vocab])


def _generate(model, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    with torch.inference_mode():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float()


def _projections(model) -> list[str]:
    """The leaf names of every linear layer in the decoder layers (what the family's checkpoint calls them)."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.model.layers.named_modules()
                   if isinstance(m, torch.nn.Linear)})


@pytest.fixture(scope="module", params=sorted(ARCH))
def case(request, tmp_path_factory):
    name = request.param
    config = family_config(name)
    config.architectures = [ARCH[name]]
    root = tmp_path_factory.mktemp(f"lora-{name}")
    seed = sorted(ARCH).index(name) + 31
    base = save_tiny(root / "base", config, seed=seed)
    targets = _projections(base)
    peft = make_adapter(base, root / "adapter", seed=seed, r=4, lora_alpha=8, target_modules=targets)
    gen = torch.Generator().manual_seed(seed)
    first = torch.randint(3, 500, (37,), generator=gen).tolist()
    second = first[:20] + torch.randint(3, 500, (6,), generator=gen).tolist()
    requests = [(first, None), (first, "adapter"), (second, "adapter")]
    refs = [_generate(base if a is None else peft, p) for p, a in requests]
    # The adapter is not a no-op on these prompts (else equal tokens would prove nothing about it).
    assert (refs[1][1][0] - refs[0][1][0]).abs().max() > 1e-2, name
    return Case(name, str(root), targets, requests, refs)


def _assert_matches(case: Case, tensor_parallel_size: int) -> None:
    from vllite_core import LLM, LoRARequest, SamplingParams

    llm = LLM(f"{case.path}/base", dtype="float32", tensor_parallel_size=tensor_parallel_size, enable_lora=True,
              max_loras=1, max_lora_rank=8, max_num_batched_tokens=16, block_size=4, num_kv_blocks=96)
    try:
        lora = LoRARequest("adapter", 1, f"{case.path}/adapter")
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in case.requests], params,
                            lora_request=[None if a is None else lora for _, a in case.requests])
    finally:
        llm.llm_engine.core.shutdown()
    for i, (out, (ref_tokens, ref_logits)) in enumerate(zip(outs, case.refs)):
        comp = out.outputs[0]
        what = (case.name, case.targets, "base" if case.requests[i][1] is None else "adapter", i)
        assert comp.token_ids == ref_tokens, what
        ref = torch.log_softmax(ref_logits, dim=-1)
        for step, (lp, tok) in enumerate(zip(comp.logprobs, comp.token_ids)):
            assert abs(lp[tok].logprob - float(ref[step, tok])) < 1e-4, (*what, step)


def test_adapter_matches_peft(case):
    _assert_matches(case, 1)


# The families whose sharding differs from Llama's (which tests/worker/test_lora_tensor_parallel.py covers):
# every other family's extras (per-head q/k norms, soft-capping, multipliers, NoPE layers) act within a head or
# after the all-reduce, so two ranks add nothing for them beyond an engine start-up each.
SHARDED_DIFFERENTLY = ("olmo2", "phi3", "glm4", "gemma3")


@pytest.mark.slow
def test_two_ranks_match_hf_and_peft(case):
    """Each rank its heads (OLMo 2's single KV head replicated; its all-heads q/k norm summed over ranks), its
    MLP columns, and its rows of each adapter's B in q/k/v and gate/up (Phi-3's and GLM-4's stacked projections
    cut per fused tensor) and columns of A in o_proj / down_proj; Gemma 3's sliding and global layers."""
    if case.name not in SHARDED_DIFFERENTLY:
        pytest.skip(f"{case.name} shards as Llama does (SHARDED_DIFFERENTLY)")
    _assert_matches(case, 2)
