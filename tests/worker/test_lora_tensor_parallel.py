"""LoRA over two tensor-parallel ranks (the mp executor): requests carry a LoRARequest, each rank loads its
own shard of the adapter (lora_B cut by output rows in q/k/v and gate/up, lora_A by input columns in o_proj
and down_proj, summed by the layer's all-reduce); a batch mixing three PEFT adapters and the base model gives
peft's greedy tokens on HF (logprobs within 1e-4). The model splits unevenly (one KV head replicated on both
ranks, an MLP width of 97). An adapter the workers cannot load fails its request alone. (The ray executor:
test_ray_executor.py.)"""
from __future__ import annotations

import shutil

import pytest
import torch
from hf_reference import hf_greedy, hf_logits
from lora_fixtures import ADAPTERS, make_adapter
from tiny_models import TINY, save_tiny

from vllite_core import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.slow  # two worker processes and three peft references: minutes on two shared cores

NEW = 10
UNEVEN = dict(TINY, vocab_size=509, intermediate_size=97, num_attention_heads=4, num_key_value_heads=1)


def lora_case(root):
    """(base path, peft models, LoRARequests, prompts, adapter names, peft's greedy tokens) on an uneven Llama."""
    from transformers import LlamaConfig

    base = save_tiny(root / "base", LlamaConfig(**UNEVEN, architectures=["LlamaForCausalLM"]))
    peft = {n: make_adapter(base, root / n, seed=i + 1, **cfg) for i, (n, cfg) in enumerate(ADAPTERS.items())}
    reqs = {n: LoRARequest(n, i + 1, str(root / n)) for i, n in enumerate(ADAPTERS)}
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 509, (n,), generator=gen).tolist() for n in (5, 30, 12, 21)]
    names = [None, *ADAPTERS]
    refs = [hf_greedy(base if n is None else peft[n], p, NEW) for p, n in zip(prompts, names)]
    return dict(root=root, base=base, peft=peft, reqs=reqs, prompts=prompts, names=names, refs=refs)


def check_matches_peft(llm, case):
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in case["prompts"]], sp,
                        lora_request=[None if n is None else case["reqs"][n] for n in case["names"]])
    assert [o.outputs[0].token_ids for o in outs] == case["refs"]
    for p, n, o in zip(case["prompts"], case["names"], outs):
        toks = o.outputs[0].token_ids
        ref = torch.log_softmax(hf_logits(case["base"] if n is None else case["peft"][n], p + toks[:-1])[len(p) - 1:],
                                dim=-1)
        got = torch.tensor([lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, toks)])
        assert torch.allclose(got, ref[torch.arange(len(toks)), torch.tensor(toks)], atol=1e-4), n


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return lora_case(tmp_path_factory.mktemp("lora-tp"))


@pytest.fixture(scope="module")
def tp2(case):
    # Two slots for three adapters: slots are reloaded on both ranks as the adapters take turns.
    llm = LLM(str(case["root"] / "base"), dtype="float32", tensor_parallel_size=2, enable_lora=True, max_loras=2,
              max_lora_rank=16, num_kv_blocks=64, max_num_batched_tokens=32)
    yield llm
    llm.llm_engine.core.shutdown()


def test_adapters_change_the_output(case):
    for p, n, ref in zip(case["prompts"], case["names"], case["refs"]):
        if n is not None:
            assert ref != hf_greedy(case["base"], p, NEW), n


def test_mixed_batch_over_two_ranks_matches_peft(case, tp2):
    assert tp2.llm_engine.core.engine_core.executor.backend == "mp"
    check_matches_peft(tp2, case)


def test_an_adapter_the_workers_cannot_load_fails_its_request_alone(case, tp2, tmp_path):
    """The API side has the adapter checked and cached; the workers were told to forget it and its files are
    gone: the request ends with an error naming the adapter, the others of its batch are unchanged."""
    gone = tmp_path / "gone"
    shutil.copytree(case["root"] / "qv-r4", gone)
    req = LoRARequest("gone", 40, str(gone))
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    first = tp2.generate({"prompt_token_ids": case["prompts"][1]}, sp, lora_request=req)
    assert first[0].outputs[0].token_ids == case["refs"][1]  # the same weights as qv-r4
    tp2.llm_engine.core.remove_lora(40)
    shutil.rmtree(gone)
    outs = tp2.generate([{"prompt_token_ids": p} for p in case["prompts"][:2]], sp, lora_request=[None, req])
    assert outs[0].outputs[0].token_ids == case["refs"][0] and outs[0].outputs[0].error is None
    bad = outs[1].outputs[0]
    assert bad.finish_reason == "error" and "'gone'" in bad.error and bad.token_ids == []
    check_matches_peft(tp2, case)  # the engine goes on
