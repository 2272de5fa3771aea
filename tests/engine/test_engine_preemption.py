"""Under KV pressure nothing is lost: preemption by recompute gives the same greedy tokens; aborts free blocks."""
from __future__ import annotations

import pytest
import torch
from hf_reference import hf_greedy
from tiny_models import TINY, save_tiny

from vllite_core import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tiny-llama")
    hf = save_tiny(path, LlamaConfig(**TINY, architectures=["LlamaForCausalLM"]))
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 512, (int(n),), generator=gen).tolist()
               for n in torch.randint(100, 141, (32,), generator=gen)]
    return str(path), hf, prompts


def _generate(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_small_kv_cache_preempts_and_loses_nothing(tiny, policy):
    path, hf, prompts = tiny
    ample = LLM(model=path, dtype="float32", num_kv_blocks=2000)
    reference = _generate(ample, prompts)
    assert reference[:3] == [hf_greedy(hf, p, 24) for p in prompts[:3]]
    small = LLM(model=path, dtype="float32", num_kv_blocks=40, scheduling_policy=policy)
    assert _generate(small, prompts) == reference
    stats = small.llm_engine.core.stats()
    assert stats.num_preemptions_total > 0
    assert small.llm_engine.core.engine_core.kv_cache_manager.get_num_free_blocks() == 39  # all back (one null block)


def test_aborts_free_blocks_and_spare_the_others(tiny):
    path, hf, prompts = tiny
    llm = LLM(model=path, dtype="float32", num_kv_blocks=40, max_num_batched_tokens=64)
    engine = llm.llm_engine
    kv = engine.core.engine_core.kv_cache_manager
    free0 = kv.get_num_free_blocks()
    ids = [f"r{i}" for i in range(6)]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, {"prompt_token_ids": p}, GREEDY)
    sched = engine.core.engine_core.scheduler
    aborted: dict[str, str] = {}
    done: dict[str, list[int]] = {}
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        for r in list(sched.requests.values()):
            rid = r.request_id
            mid_prefill = r.status.name == "RUNNING" and 0 < r.num_computed_tokens < r.num_prompt_tokens
            if "prefill" not in aborted.values() and mid_prefill:
                aborted[rid] = "prefill"
            elif "decode" not in aborted.values() and r.status.name == "RUNNING" and r.num_output_tokens >= 3:
                aborted[rid] = "decode"
            elif "preempted" not in aborted.values() and r.status.name == "PREEMPTED":
                aborted[rid] = "preempted"
            else:
                continue
            engine.abort_request(rid)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert set(aborted.values()) >= {"prefill", "decode"}
    assert kv.get_num_free_blocks() == free0
    ref = {rid: hf_greedy(hf, p, 24) for rid, p in zip(ids, prompts)}
    for rid, toks in done.items():
        if rid not in aborted:
            assert toks == ref[rid]
    assert not set(aborted) & {rid for rid, t in done.items() if len(t) == 24}
