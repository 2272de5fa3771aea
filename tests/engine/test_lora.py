"""Multi-LoRA offline: a batch mixing three PEFT adapters and the base model against peft on HF
(greedy tokens identical, logprobs within 1e-4), more adapters than slots, the prefix-cache
identity of adapters, refused adapters (the op itself: test_lora_ops.py)."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from hf_reference import hf_greedy, hf_logits
from lora_fixtures import ADAPTERS, make_adapter
from tiny_models import TINY, save_tiny

from vllite_core import LLM, LoRARequest, SamplingParams
from vllite_core.errors import InvalidRequestError
from vllite_core.lora.errors import LoRAError
from vllite_core.lora.request import LoRARequest as LoRARequestDirect

NEW = 12
HI = {"prompt_token_ids": [1, 2, 3]}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import LlamaConfig

    root = tmp_path_factory.mktemp("lora")
    base = save_tiny(root / "base", LlamaConfig(**TINY, architectures=["LlamaForCausalLM"]))
    peft = {n: make_adapter(base, root / n, seed=i + 1, **cfg) for i, (n, cfg) in enumerate(ADAPTERS.items())}
    reqs = {n: LoRARequest(n, i + 1, str(root / n)) for i, n in enumerate(ADAPTERS)}
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (5, 17, 40, 23, 9, 31, 12, 50)]
    names = [None, *ADAPTERS] * 2  # every adapter and the base, twice, interleaved
    refs = [hf_greedy(base if n is None else peft[n], p, NEW) for p, n in zip(prompts, names)]
    return dict(root=root, base=base, peft=peft, reqs=reqs, prompts=prompts, names=names, refs=refs)


@pytest.fixture(scope="module")
def llm(setup):
    # A small token budget: chunked prefills of one adapter share steps with decodes of the others.
    return LLM(model=str(setup["root"] / "base"), dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=16,
               max_num_batched_tokens=48, num_kv_blocks=128)


def _sp(**kw):
    return SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, **kw)


def _lora_list(setup):
    return [None if n is None else setup["reqs"][n] for n in setup["names"]]


def test_importable_from_both_places():
    assert LoRARequest is LoRARequestDirect


def test_adapters_change_the_output(setup):
    """The adapters are not no-ops (else the comparison below proves nothing)."""
    for p, n, ref in zip(setup["prompts"], setup["names"], setup["refs"]):
        if n is not None:
            assert ref != hf_greedy(setup["base"], p, NEW), n


def test_mixed_batch_matches_peft(setup, llm):
    outs = llm.generate([{"prompt_token_ids": p} for p in setup["prompts"]], _sp(logprobs=0),
                        lora_request=_lora_list(setup))
    assert [o.outputs[0].token_ids for o in outs] == setup["refs"]
    for p, n, o in zip(setup["prompts"], setup["names"], outs):
        model = setup["base"] if n is None else setup["peft"][n]
        toks = o.outputs[0].token_ids
        ref_lp = torch.log_softmax(hf_logits(model, p + toks[:-1])[len(p) - 1:], dim=-1)
        got = torch.tensor([lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, toks)])
        want = ref_lp[torch.arange(len(toks)), torch.tensor(toks)]
        assert torch.allclose(got, want, atol=1e-4), (n, (got - want).abs().max())


def test_one_request_for_every_prompt(setup, llm):
    p = setup["prompts"][:2]
    n = "qv-r4"
    outs = llm.generate([{"prompt_token_ids": x} for x in p], _sp(), lora_request=setup["reqs"][n])
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(setup["peft"][n], x, NEW) for x in p]


def test_more_adapters_than_slots_all_finish_unchanged(setup):
    llm = LLM(model=str(setup["root"] / "base"), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
              max_cpu_loras=2, num_kv_blocks=128)
    sched = llm.llm_engine.core.engine_core.scheduler
    seen: list[int] = []
    schedule = sched.schedule

    def counting():
        out = schedule()
        seen.append(len({sched.requests[r].lora_int_id for r in out.num_scheduled_tokens} - {0}))
        return out

    sched.schedule = counting
    outs = llm.generate([{"prompt_token_ids": p} for p in setup["prompts"]], _sp(), lora_request=_lora_list(setup))
    assert [o.outputs[0].token_ids for o in outs] == setup["refs"]
    assert max(seen) == 2  # three adapters in flight, never more than two in a step
    assert llm.llm_engine.core.engine_core.worker.runner.lora.loads >= 3  # slots were reused (LRU eviction)
    assert len(llm.llm_engine.lora_registry.list_loras()) == 2  # the CPU cache holds max_cpu_loras


def test_prefix_cache_identity_of_adapters(setup, tmp_path):
    llm = LLM(model=str(setup["root"] / "base"), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
              num_kv_blocks=128, enable_prefix_caching=True)
    prompt = {"prompt_token_ids": setup["prompts"][-1][:48]}  # three full blocks of 16
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    reload_dir = tmp_path / "qv-r4-retrained"
    make_adapter(setup["base"], reload_dir, seed=99, **ADAPTERS["qv-r4"])
    qv, other = setup["reqs"]["qv-r4"], setup["reqs"]["mlp-ko-r2"]

    def cached(req):
        return llm.generate(prompt, sp, lora_request=req)[0].num_cached_tokens

    table = [("qv-r4 first", cached(qv), 0), ("qv-r4 again", cached(qv), 32),
             ("another adapter, same prompt", cached(other), 0), ("the base model", cached(None), 0),
             ("qv-r4 reloaded with other weights (new id)",
              cached(LoRARequest("qv-r4", 10, str(reload_dir))), 0),
             ("qv-r4 as it was", cached(qv), 32)]
    assert [(what, got) for what, got, _ in table] == [(what, want) for what, _, want in table]


def _broken(setup, tmp_path, name, edit=None, files=None):
    d = tmp_path / name
    shutil.copytree(setup["root"] / "qv-r4", d)
    if edit:
        cfg = json.loads((d / "adapter_config.json").read_text())
        cfg.update(edit)
        (d / "adapter_config.json").write_text(json.dumps(cfg))
    if files:
        files(d)
    return LoRARequest(name, 100 + len(os.listdir(tmp_path)), str(d))


def test_bad_adapters_are_refused_naming_the_field(setup, llm, tmp_path):
    def to_bin(d):
        os.rename(d / "adapter_model.safetensors", d / "adapter_model.bin")

    def corrupt(d):
        (d / "adapter_model.safetensors").write_bytes(b"not a safetensors file")

    cases = {
        "r": dict(edit={"r": 32}),
        "use_dora": dict(edit={"use_dora": True}),
        "bias": dict(edit={"bias": "all"}),
        "modules_to_save": dict(edit={"modules_to_save": ["lm_head"]}),
        "target_modules": dict(edit={"target_modules": ["q_proj", "foo_proj"]}),
        "adapter_model.safetensors": dict(files=to_bin),
    }
    for field, how in cases.items():
        with pytest.raises(LoRAError) as e:
            llm.generate(HI, _sp(), lora_request=_broken(setup, tmp_path, f"bad-{field}", **how))
        assert e.value.param == field and f"bad-{field}" in str(e.value), str(e.value)
    with pytest.raises(LoRAError, match="pickled"):
        llm.generate(HI, _sp(), lora_request=_broken(setup, tmp_path, "bin-only", files=to_bin))
    with pytest.raises(LoRAError, match="cannot be parsed"):
        llm.generate(HI, _sp(), lora_request=_broken(setup, tmp_path, "corrupt", files=corrupt))
    with pytest.raises(LoRAError, match="lora_path"):
        llm.generate(HI, _sp(), lora_request=LoRARequest("nowhere", 300, str(tmp_path / "missing")))
    with pytest.raises(LoRAError, match="lora_int_id"):
        LoRARequest("x", 0, "/tmp")
    with pytest.raises(LoRAError, match="already adapter 'qv-r4'"):  # one id, one adapter
        llm.generate(HI, _sp(), lora_request=LoRARequest("impostor", 1, str(setup["root"] / "mlp-ko-r2")))
    # The engine serves on, unchanged.
    out = llm.generate({"prompt_token_ids": setup["prompts"][1]}, _sp(), lora_request=setup["reqs"]["qv-r4"])
    assert out[0].outputs[0].token_ids == setup["refs"][1]


def test_adapter_of_another_model_shape_is_refused(setup, tmp_path):
    from transformers import LlamaConfig

    other = save_tiny(tmp_path / "wide", LlamaConfig(**{**TINY, "hidden_size": 32, "num_attention_heads": 2,
                                                        "num_key_value_heads": 1},
                                                     architectures=["LlamaForCausalLM"]))
    make_adapter(other, tmp_path / "wide-lora", seed=1, **ADAPTERS["qv-r4"])
    llm = LLM(model=str(setup["root"] / "base"), dtype="float32", enable_lora=True, num_kv_blocks=32)
    with pytest.raises(LoRAError, match="do not fit"):
        llm.generate(HI, _sp(), lora_request=LoRARequest("wide", 1, str(tmp_path / "wide-lora")))


def test_lora_request_without_enable_lora(setup):
    llm = LLM(model=str(setup["root"] / "base"), dtype="float32", num_kv_blocks=32)
    with pytest.raises(InvalidRequestError, match="enable_lora"):
        llm.generate(HI, _sp(), lora_request=setup["reqs"]["qv-r4"])
