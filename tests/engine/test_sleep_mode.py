"""Sleep mode, collective_rpc and weight updates (issue 57 item 8), against references that are not the
code under test: the process's resident memory as the OS reports it (psutil), the sizes of the safetensors
files, and Hugging Face's greedy tokens on the same weights."""
from __future__ import annotations

import os

import psutil
import pytest
import torch
from hf_reference import hf_greedy
from tiny_models import TINY, save_tiny

from vllite_core.entrypoints.llm import LLM
from vllite_core.errors import ConfigError, EngineSleepingError
from vllite_core.sampling_params import SamplingParams

PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 11, 64, 300, 12, 8, 77, 19, 23, 111, 2, 9], [400, 33, 21, 18, 6, 90]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
# Big enough that released memory stands out of allocator noise: ~34 MB of float32 weights.
WIDE = dict(TINY, hidden_size=512, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=4)
KV_BLOCKS = 512  # 2 layers x K/V x 16 tokens x 4 heads x 64 x 4 bytes = 64 KiB a block: 32 MiB


def _llama(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(**kw, architectures=["LlamaForCausalLM"])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two tiny Llamas (A, B: other weights, same shapes) and a wide one; HF's greedy tokens for A and B."""
    root = tmp_path_factory.mktemp("sleep")
    refs = {}
    for name, seed in (("a", 0), ("b", 1)):
        hf = save_tiny(root / name, _llama(**TINY), seed=seed)
        refs[name] = [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]
        del hf
    save_tiny(root / "wide", _llama(**WIDE), seed=2)
    return root, refs


def _tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]


def _rss(pid: int | None = None) -> int:
    return psutil.Process(pid).memory_info().rss


def _file_bytes(folder) -> int:
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))


def _fill_kv_cache(worker) -> int:
    """Touch every page of the worker's KV cache (an idle cache's pages are not resident until written):
    the cache then counts in full in the process's RSS. Returns its bytes."""
    distinct = {t.data_ptr(): t for t in worker.runner.kv_caches}  # layers may share a tensor
    for t in distinct.values():
        t.fill_(1)
    return sum(t.numel() * t.element_size() for t in distinct.values())


def _rank(worker, offset: int = 0) -> int:
    return worker.tp.rank + offset


def test_sleep_needs_enable_sleep_mode(models):
    root, _ = models
    llm = LLM(str(root / "a"), dtype="float32", num_kv_blocks=64)
    try:
        with pytest.raises(ConfigError, match="enable_sleep_mode"):
            llm.sleep(1)
    finally:
        llm.llm_engine.core.shutdown()


def test_sleep_levels_release_memory_and_wake_up_restores_tokens(models):
    """Level 1: RSS down by at least the KV cache; level 2: by the KV cache and the weights (the safetensors'
    size); greedy tokens after each wake_up equal those before; requests while asleep are refused."""
    root, _ = models
    llm = LLM(str(root / "wide"), dtype="float32", num_kv_blocks=KV_BLOCKS, enable_sleep_mode=True)
    try:
        before = _tokens(llm)
        assert not llm.is_sleeping()
        kv_bytes = llm.collective_rpc(_fill_kv_cache)[0]
        assert kv_bytes >= 32 * 2**20
        rss = _rss()
        llm.sleep(level=1)
        assert llm.is_sleeping()
        assert rss - _rss() >= kv_bytes
        with pytest.raises(EngineSleepingError, match="sleeping"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY)
        llm.wake_up()
        assert not llm.is_sleeping()
        assert _tokens(llm) == before

        weight_bytes = _file_bytes(root / "wide")
        llm.collective_rpc(_fill_kv_cache)
        rss = _rss()
        llm.sleep(level=2)
        assert rss - _rss() >= kv_bytes + weight_bytes
        llm.wake_up(tags=["weights"])
        assert llm.is_sleeping()  # the KV cache is still released
        llm.wake_up(tags=["kv_cache"])
        assert not llm.is_sleeping()
        assert _tokens(llm) == before
    finally:
        llm.llm_engine.core.shutdown()


def test_collective_rpc_by_name_and_function(models):
    root, _ = models
    llm = LLM(str(root / "a"), dtype="float32", num_kv_blocks=64)
    try:
        assert llm.collective_rpc(_rank, args=(10,)) == [10]
        assert llm.collective_rpc(_rank, kwargs={"offset": 3}) == [3]
        assert llm.collective_rpc("is_sleeping") == [False]
        with pytest.raises(ValueError, match="no method 'no_such_method'"):
            llm.collective_rpc("no_such_method")
        assert _tokens(llm)  # the engine serves on after a refused call
    finally:
        llm.llm_engine.core.shutdown()


def _state_dict(folder) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return list(load_file(os.path.join(folder, "model.safetensors")).items())


def test_weights_swapped_in_give_the_new_models_tokens(models):
    """An engine running model A, given model B's weights (as a state dict, then from a folder), answers
    with HF's greedy tokens for B (then A); the prefix cache serves no block computed with A's weights."""
    root, refs = models
    assert refs["a"] != refs["b"]
    llm = LLM(str(root / "a"), dtype="float32", num_kv_blocks=64, enable_prefix_caching=True)
    try:
        assert _tokens(llm) == refs["a"]
        assert _tokens(llm) == refs["a"]  # now served from cached prefixes
        filled = llm.collective_rpc("load_weights", args=(_state_dict(root / "b"),))
        assert filled[0] > 0
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
        assert [list(o.outputs[0].token_ids) for o in outs] == refs["b"]
        assert all(o.num_cached_tokens == 0 for o in outs)  # nothing of A's K/V was reused
        llm.collective_rpc("reload_weights", args=(str(root / "a"),))
        assert _tokens(llm) == refs["a"]
        with pytest.raises(ValueError, match="does not know"):
            llm.collective_rpc("load_weights", args=([("no.such.weight", torch.zeros(2))],))
    finally:
        llm.llm_engine.core.shutdown()


def _worker_pid(worker) -> int:
    return os.getpid()


@pytest.mark.slow
def test_tensor_parallel_sleep_and_weight_swap(models):
    """mp executor, two ranks: each worker process's RSS drops by at least its KV cache shard at level 1,
    tokens equal HF's after wake_up, and model B's weights loaded into both ranks give B's tokens."""
    root, refs = models
    llm = LLM(str(root / "a"), dtype="float32", num_kv_blocks=2048, enable_sleep_mode=True,
              tensor_parallel_size=2, distributed_executor_backend="mp")
    try:
        assert llm.collective_rpc(_rank) == [0, 1]
        assert _tokens(llm) == refs["a"]
        pids = llm.collective_rpc(_worker_pid)
        kv = llm.collective_rpc(_fill_kv_cache)
        rss = [_rss(p) for p in pids]
        llm.sleep(level=1)
        assert all(r - _rss(p) >= b for r, p, b in zip(rss, pids, kv))
        llm.wake_up()
        assert _tokens(llm) == refs["a"]
        llm.collective_rpc("load_weights", args=(_state_dict(root / "b"),))
        assert _tokens(llm) == refs["b"]
        llm.sleep(level=2)
        llm.wake_up()  # reloads the checkpoint the engine started with: A
        assert _tokens(llm) == refs["a"]
    finally:
        llm.llm_engine.core.shutdown()


@pytest.mark.slow
def test_engine_core_process_sleep_rpc_and_weights(models):
    """The engine core in its own process (MPClient): the calls cross the core's socket as typed messages;
    its RSS drops by the KV cache at level 1; a request while asleep fails with a clear error; a call that
    raises there raises here and the engine serves on."""
    from vllite_core.config import EngineArgs
    from vllite_core.engine.llm_engine import LLMEngine
    from vllite_core.engine.mp_client import MPClient

    root, refs = models
    args = EngineArgs.from_kwargs(model=str(root / "a"), dtype="float32", num_kv_blocks=1024,
                                  enable_sleep_mode=True)
    client = MPClient(args.create_config())
    try:
        llm = LLM.from_engine(LLMEngine(client.info.config, core=client))
        assert _tokens(llm) == refs["a"]
        (pid,) = llm.collective_rpc(_worker_pid)
        assert pid != os.getpid() and pid == client.layout()["engine_cores"][0]["pid"]
        (kv,) = llm.collective_rpc(_fill_kv_cache)
        rss = _rss(pid)
        llm.sleep(level=1)
        assert llm.is_sleeping()
        assert rss - _rss(pid) >= kv
        with pytest.raises(EngineSleepingError):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY)
        with pytest.raises(ValueError, match="level"):
            llm.sleep(level=3)
        llm.wake_up()
        assert not llm.is_sleeping()
        assert _tokens(llm) == refs["a"]
        # vLLM's modes: "keep" and unknown names refused; "wait" with a request in flight refused (offline
        # nothing steps it meanwhile); "abort" (the default) ends it and sleeps.
        engine = llm.llm_engine
        engine.add_request("in-flight", {"prompt_token_ids": PROMPTS[0]}, GREEDY)
        engine.step()
        for mode, match in (("keep", "keep"), ("later", "mode"), ("wait", "in flight")):
            with pytest.raises(ValueError, match=match):
                llm.sleep(level=1, mode=mode)
            assert not llm.is_sleeping()
        llm.sleep(level=1, mode="abort")
        assert llm.is_sleeping() and engine.get_num_unfinished_requests() == 0
        llm.wake_up()
        assert _tokens(llm) == refs["a"]
        llm.collective_rpc("load_weights", args=(_state_dict(root / "b"),))
        assert _tokens(llm) == refs["b"]
    finally:
        client.shutdown()


def test_dev_mode_flag_spellings():
    from vllite_core.entrypoints.openai.serving_dev import dev_mode_enabled

    assert not dev_mode_enabled({})
    assert dev_mode_enabled({"VLLITE_SERVER_DEV_MODE": "1"})
    assert dev_mode_enabled({"VLLM_SERVER_DEV_MODE": "1"})
    assert not dev_mode_enabled({"VLLM_SERVER_DEV_MODE": "0"})


@pytest.mark.slow
def test_server_dev_routes(models):
    """`vllite serve` with VLLM_SERVER_DEV_MODE=1: /sleep, /is_sleeping, /wake_up and /collective_rpc over
    HTTP (engine core in its own process); the official openai client gets 503 while the engine sleeps and
    the same greedy text after wake_up. Without the flag the routes do not exist."""
    import httpx
    import openai
    from server_harness import ServerProcess

    root, _ = models
    server = ServerProcess([str(root / "a"), "--dtype", "float32", "--num-kv-blocks", "64", "--enable-sleep-mode"],
                           env={"VLLM_SERVER_DEV_MODE": "1"})
    try:
        url = server.wait_ready()
        http = httpx.Client(timeout=120)  # a shared 2-core host: calls can take seconds
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")

        def complete() -> str:
            return client.completions.create(model=str(root / "a"), prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text

        before = complete()
        assert http.get(url + "/is_sleeping").json() == {"is_sleeping": False}
        assert http.post(url + "/sleep", params={"level": 1}).status_code == 200
        assert http.get(url + "/is_sleeping").json() == {"is_sleeping": True}
        with pytest.raises(openai.APIStatusError) as err:
            complete()
        assert err.value.status_code == 503 and "sleeping" in str(err.value)
        assert http.post(url + "/sleep", params={"level": 5}).status_code == 400
        assert http.post(url + "/wake_up", params={"tags": ["kv_cache"]}).status_code == 200
        assert http.get(url + "/is_sleeping").json() == {"is_sleeping": False}
        assert complete() == before

        # vLLM's sleep modes for the requests in flight: "abort" (the default) ends a stream at once with
        # finish_reason "abort"; "wait" answers once it is done (all its tokens, the same text as awake).
        def stream_until_sleep(mode: str) -> tuple[str, str | None]:
            import threading

            long = dict(model=str(root / "a"), prompt=PROMPTS[0], max_tokens=230, temperature=0, stream=True,
                        extra_body={"ignore_eos": True})
            started, done = threading.Event(), {}

            def read() -> None:
                text, finish = "", None
                for chunk in client.completions.create(**long):
                    started.set()
                    text += chunk.choices[0].text
                    finish = chunk.choices[0].finish_reason or finish
                done["out"] = (text, finish)

            t = threading.Thread(target=read)
            t.start()
            assert started.wait(60)
            assert http.post(url + "/sleep", params={"level": 1, "mode": mode}).status_code == 200
            t.join(60)
            assert http.post(url + "/wake_up").status_code == 200
            return done["out"]

        full = client.completions.create(model=str(root / "a"), prompt=PROMPTS[0], max_tokens=230, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text
        text, finish = stream_until_sleep("abort")
        assert finish == "abort" and full.startswith(text) and len(text) < len(full)
        assert stream_until_sleep("wait") == (full, "length")
        for mode in ("keep", "later"):
            r = http.post(url + "/sleep", params={"level": 1, "mode": mode})
            assert r.status_code == 400 and r.json()["error"]["param"] == "mode", r.text
        assert http.get(url + "/is_sleeping").json() == {"is_sleeping": False}
        assert complete() == before
        rpc = http.post(url + "/collective_rpc", json={"method": "reload_weights", "args": [str(root / "b")]})
        assert rpc.status_code == 200 and rpc.json()["results"][0] > 0
        assert complete() != before  # model B's weights now
    finally:
        server.stop()
    plain = ServerProcess([str(root / "a"), "--dtype", "float32", "--num-kv-blocks", "64"])
    try:
        url = plain.wait_ready()
        assert httpx.post(url + "/sleep").status_code == 404
    finally:
        plain.stop()
