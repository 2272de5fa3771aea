"""The ray executor on a local Ray cluster of two nodes (``ray start --head`` plus ``ray start --address``,
one CPU each, both on 127.0.0.1, started here and stopped afterwards): tensor parallelism and pipeline
parallelism over two actors on two nodes give Hugging Face's greedy tokens (pipeline stages of a dense model
and of a hybrid whose stages hold different caches); a lost actor fails the step
naming its rank and node; no ray package / no cluster is a clear ConfigError."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from hf_reference import hf_greedy
from test_tensor_parallel import QWEN2
from tiny_models import save_tiny

from vllite_core import LLM, SamplingParams
from vllite_core.errors import ConfigError
from vllite_core.executor.errors import WorkerDiedError
from vllite_core.executor.multiproc import free_port

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

RAY = os.path.join(os.path.dirname(sys.executable), "ray")
NODE_ARGS = ["--num-cpus=1", "--object-store-memory=100000000", "--block", "--disable-usage-stats"]


def _start(args: list[str], tmp: str) -> subprocess.Popen:
    # Own session: the node's daemons are stopped with its process group, not by name.
    return subprocess.Popen([RAY, "start", *args, *NODE_ARGS], start_new_session=True, cwd=tmp,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})


def _alive_nodes(address: str) -> int:
    out = subprocess.run([RAY, "status", f"--address={address}"], capture_output=True, text=True, timeout=60)
    return out.stdout.split("Pending:")[0].count("node_") if out.returncode == 0 else 0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("ray"))
    port = free_port()
    address = f"127.0.0.1:{port}"
    nodes = [_start(["--head", f"--port={port}", "--include-dashboard=false"], tmp)]
    try:
        deadline = time.monotonic() + 120
        while _alive_nodes(address) < 1 and time.monotonic() < deadline:
            time.sleep(1)
        nodes.append(_start([f"--address={address}"], tmp))
        while _alive_nodes(address) < 2 and time.monotonic() < deadline:
            time.sleep(1)
        assert _alive_nodes(address) == 2, "the local two-node Ray cluster did not come up"
        yield address
    finally:
        for p in reversed(nodes):  # a node given SIGTERM took 30 s to go: 5 s of grace, then SIGKILL
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(5)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(p.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    from transformers import Qwen2Config

    path = tmp_path_factory.mktemp("tiny-qwen2-ray")
    hf = save_tiny(path, Qwen2Config(**QWEN2, architectures=["Qwen2ForCausalLM"]))
    gen = torch.Generator().manual_seed(9)
    return str(path), hf, [torch.randint(0, 509, (n,), generator=gen).tolist() for n in (4, 37)]


def test_no_cluster_is_a_config_error(monkeypatch, tiny_path):
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{free_port()}")
    with pytest.raises(ConfigError, match="no Ray cluster reachable"):
        LLM(tiny_path, dtype="float32", tensor_parallel_size=2, distributed_executor_backend="ray")


def test_ray_not_installed_is_a_config_error(monkeypatch, tiny_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    with pytest.raises(ConfigError, match="needs the ray package"):
        LLM(tiny_path, dtype="float32", tensor_parallel_size=2, distributed_executor_backend="ray")


def test_two_nodes_match_hf_and_a_lost_actor_names_its_rank(cluster, qwen2, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", cluster)
    path, hf, prompts = qwen2
    llm = LLM(path, dtype="float32", tensor_parallel_size=2, distributed_executor_backend="ray", num_kv_blocks=64,
              max_num_batched_tokens=16)
    try:
        executor = llm.llm_engine.core.engine_core.executor
        assert executor.layout["nodes"] == 2 and executor.layout["ranks"] == 2
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 8) for p in prompts]
        ray.kill(executor.actors[1])
        with pytest.raises(WorkerDiedError, match=r"worker rank 1 on node \w+") as info:
            llm.generate([{"prompt_token_ids": prompts[0]}], params)
        assert info.value.rank == 1
    finally:
        llm.llm_engine.core.shutdown()


def test_two_pipeline_stages_on_two_nodes_match_hf(cluster, qwen2, monkeypatch):
    """PP=2: stage 0 (the embedding, layer 0) on one node's actor, stage 1 (layer 1, norm, head) on the other's;
    activations cross by torch.distributed send/recv, two batches in flight (the 16-token budget splits them)."""
    monkeypatch.setenv("RAY_ADDRESS", cluster)
    path, hf, prompts = qwen2
    llm = LLM(path, dtype="float32", pipeline_parallel_size=2, distributed_executor_backend="ray", num_kv_blocks=64,
              max_num_batched_tokens=16)
    try:
        core = llm.llm_engine.core.engine_core
        layout = core.executor.layout
        assert layout["nodes"] == 2 and layout["ranks"] == 2 and layout["pipeline_parallel_size"] == 2
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        batch = [*prompts, prompts[1][::-1]]  # three requests: more than one batch's budget
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params)
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 8) for p in batch]
        assert core.max_batches_in_flight == 2
    finally:
        llm.llm_engine.core.shutdown()


def test_hybrid_pipeline_stages_on_two_nodes_match_hf(cluster, tmp_path, monkeypatch):
    """Jamba over two nodes: stage 0 holds the Mamba layer (a recurrent state per request, no KV), stage 1 the
    attention layer (paged KV, no state); both follow the engine's two cache groups."""
    from hf_reference import hf_greedy_with
    from test_state_space_models import _configs

    monkeypatch.setenv("RAY_ADDRESS", cluster)
    hf = save_tiny(tmp_path, _configs()["jamba"]())
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (2, 17, 40)]
    llm = LLM(str(tmp_path), dtype="float32", pipeline_parallel_size=2, distributed_executor_backend="ray",
              max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=16)
    try:
        assert llm.llm_engine.core.engine_core.executor.layout["nodes"] == 2
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy_with(hf, p, 8, lambda x, *_: x) for p in prompts]
        held = llm.collective_rpc(lambda w: [type(s).__name__ for s in w.runner.tensor_plan.tensor_specs])
        assert held == [["StateSpec"], ["FullAttentionSpec"]]
    finally:
        llm.llm_engine.core.shutdown()


def test_lora_over_two_nodes_matches_peft(cluster, tmp_path, monkeypatch):
    """Requests carry a LoRARequest to the actors; each loads its shard of the adapters: peft's greedy tokens."""
    from test_lora_tensor_parallel import check_matches_peft, lora_case

    monkeypatch.setenv("RAY_ADDRESS", cluster)
    case = lora_case(tmp_path)
    llm = LLM(str(case["root"] / "base"), dtype="float32", tensor_parallel_size=2, distributed_executor_backend="ray",
              enable_lora=True, max_loras=2, max_lora_rank=16, num_kv_blocks=64, max_num_batched_tokens=32)
    try:
        check_matches_peft(llm, case)
    finally:
        llm.llm_engine.core.shutdown()


def test_data_parallel_ranks_placed_on_the_ray_cluster_serve_hf_tokens(cluster, qwen2):
    """`--data-parallel-backend ray`: the API server starts rank 1 itself, as a Ray actor on the other node
    (no --headless node): greedy completions from both ranks are HF's; stopping the server ends that rank."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    from server_harness import ServerProcess

    path, hf, prompts = qwen2
    srv = ServerProcess(["--model", path, "--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "128",
                         "--num-threads", "1", "--data-parallel-size", "2", "--data-parallel-size-local", "1",
                         "--data-parallel-backend", "ray", "--data-parallel-rpc-port", str(free_port())],
                        env={"RAY_ADDRESS": cluster})
    try:
        url = srv.wait_ready(timeout=240)
        layout = next(ln for ln in srv.lines if "process layout" in ln)
        remote_pid = int(re.search(r"DP rank 1 pid (\d+) on ", layout).group(1))
        batch = [*prompts, prompts[1][::-1], prompts[0] * 3]

        async def complete_all() -> list[str]:  # at once: the least loaded rank takes each in turn
            async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                outs = await asyncio.gather(*[client.post("/v1/completions", json={
                    "model": path, "prompt": p, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True})
                    for p in batch])
            return [o.json()["choices"][0]["text"] for o in outs]

        # the served text is the in-process engine's, whose tokens are HF's
        ref = LLM(path, dtype="float32", num_kv_blocks=64, max_model_len=128).generate(
            [{"prompt_token_ids": p} for p in batch], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        assert [r.outputs[0].token_ids for r in ref] == [hf_greedy(hf, p, 8) for p in batch]
        assert asyncio.run(complete_all()) == [r.outputs[0].text for r in ref]
        metrics = text_string_to_metric_families(httpx.get(url + "/metrics").text)
        queries = {s.labels["engine"]: s.value for fam in metrics for s in fam.samples
                   if s.name == "vllm:prefix_cache_queries_total"}
        assert set(queries) == {"0", "1"} and all(v > 0 for v in queries.values()), queries
    finally:
        srv.stop()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and os.path.exists(f"/proc/{remote_pid}"):
        time.sleep(0.5)
    assert not os.path.exists(f"/proc/{remote_pid}"), "the Ray-placed rank's engine core outlived its server"
