"""Multi-LoRA through `vllite serve` with the real openai client: adapters selected by the request's
``model``, listed in /v1/models with their parent, a concurrent mix of three adapters and the base
identical to peft on HF; runtime load/unload only under the operator's switch and allowed root."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from hf_reference import hf_greedy, hf_logits
from lora_fixtures import ADAPTERS, make_adapter
from server_harness import ServerProcess
from tiny_models import TINY, save_tiny

NEW = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import LlamaConfig

    root = tmp_path_factory.mktemp("lora-server")
    base = save_tiny(root / "base", LlamaConfig(**TINY, architectures=["LlamaForCausalLM"]))
    (root / "allowed").mkdir()
    peft = {n: make_adapter(base, root / "allowed" / n, seed=i + 1, **cfg)
            for i, (n, cfg) in enumerate(ADAPTERS.items())}
    return root, base, peft


@pytest.fixture(scope="module")
def server(setup):
    root, _, _ = setup
    names = list(ADAPTERS)
    modules = [f"{names[0]}={root / 'allowed' / names[0]}", f"{names[1]}={root / 'allowed' / names[1]}",
               json.dumps({"name": names[2], "path": str(root / "allowed" / names[2])})]
    srv = ServerProcess([str(root / "base"), "--served-model-name", "base", "--dtype", "float32",
                         "--num-kv-blocks", "128", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
                         "--lora-modules", *modules, "--lora-allowed-root", str(root / "allowed")],
                        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)


def test_models_lists_adapters_with_their_parent(client):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"base", *ADAPTERS}
    for n in ADAPTERS:
        assert models[n].parent == "base"


def test_concurrent_mix_matches_peft(setup, client):
    _, base, peft = setup
    tok = __import__("transformers").AutoTokenizer.from_pretrained(str(setup[0] / "base"))
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (7, 19, 33, 12, 25, 9, 41, 16)]
    models = ["base", *ADAPTERS] * 2

    def run(i):
        return client.completions.create(model=models[i], prompt=prompts[i], max_tokens=NEW, temperature=0.0,
                                         logprobs=0, extra_body={"ignore_eos": True})

    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(run, range(len(prompts))))
    for p, m, o in zip(prompts, models, outs):
        ref_model = base if m == "base" else peft[m]
        ref = hf_greedy(ref_model, p, NEW)
        assert o.model == m
        # The token strings say which tokens came (the text holds back a trailing partial UTF-8 character).
        assert o.choices[0].logprobs.tokens == [tok.decode([t]) for t in ref], m
        assert tok.decode(ref).startswith(o.choices[0].text)
        lp = torch.log_softmax(hf_logits(ref_model, p + ref[:-1])[len(p) - 1:], dim=-1)
        want = lp[torch.arange(NEW), torch.tensor(ref)]
        got = torch.tensor(o.choices[0].logprobs.token_logprobs)
        assert torch.allclose(got, want, atol=1e-4), m


def test_unknown_adapter_is_404_naming_model(client):
    from openai import NotFoundError

    with pytest.raises(NotFoundError) as e:
        client.completions.create(model="no-such-adapter", prompt=[1, 2, 3], max_tokens=2)
    assert e.value.body["param"] == "model"


def test_runtime_load_and_unload(setup, server, client, tmp_path):
    root, base, _ = setup
    make_adapter(base, root / "allowed" / "late", seed=42, **ADAPTERS["qv-r4"])
    make_adapter(base, tmp_path / "outside", seed=43, **ADAPTERS["qv-r4"])
    r = httpx.post(server + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path / "outside")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    sneaky = str(root / "allowed" / ".." / "base")
    r = httpx.post(server + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": sneaky})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    r = httpx.post(server + "/v1/load_lora_adapter", json={"lora_name": "base", "lora_path": str(root / "allowed")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
    r = httpx.post(server + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(root / "allowed")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "adapter_config.json"  # not an adapter
    r = httpx.post(server + "/v1/load_lora_adapter",
                   json={"lora_name": "late", "lora_path": str(root / "allowed" / "late")})
    assert r.status_code == 200, r.text
    assert "late" in {m.id for m in client.models.list().data}
    out = client.completions.create(model="late", prompt=[5, 6, 7, 8], max_tokens=3, temperature=0.0)
    assert out.model == "late"
    r = httpx.post(server + "/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert r.status_code == 200
    assert "late" not in {m.id for m in client.models.list().data}
    r = httpx.post(server + "/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"


@pytest.mark.slow
def test_no_runtime_endpoints_without_the_switch(setup):
    root, _, _ = setup
    srv = ServerProcess([str(root / "base"), "--dtype", "float32", "--num-kv-blocks", "32", "--enable-lora",
                         "--lora-modules", f"qv={root / 'allowed' / 'qv-r4'}"],
                        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "", "VLLITE_ALLOW_RUNTIME_LORA_UPDATING": ""})
    try:
        url = srv.wait_ready()
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(root / "allowed")})
        assert r.status_code == 404
        assert "qv" in {m["id"] for m in httpx.get(url + "/v1/models").json()["data"]}
    finally:
        srv.stop()
