"""What /metrics and the start-up report say about the engine core's memory (issue 58): the compiled-grammar
cache's size (within its bound, with real xgrammar compiles), the memory the core will really hold (the KV
cache counted in full: computed from the model config, not from the code under test), and
``commit_kv_cache`` making the engine-core process's RSS (/proc/<pid>/status) grow by the cache's size."""
from __future__ import annotations

import asyncio

import pytest

from vllite_core.config import EngineArgs
from vllite_core.core.stats import SchedulerStats, combine
from vllite_core.engine.async_llm import AsyncLLM
from vllite_core.engine.llm_engine import LLMEngine
from vllite_core.engine.serial_utils import MsgpackDecoder, MsgpackEncoder
from vllite_core.sampling_params import SamplingParams, StructuredOutputsParams

GRAMMAR_BOUND = 512 << 10


def kv_bytes_per_block(hf_config, block_size: int, itemsize: int = 4) -> int:
    """K and V of every layer for one block, from the HF config (a Llama: no sliding window, no MLA)."""
    head_dim = hf_config.hidden_size // hf_config.num_attention_heads
    return 2 * hf_config.num_hidden_layers * block_size * hf_config.num_key_value_heads * head_dim * itemsize


def metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in /metrics")


def test_grammar_cache_fields_cross_the_process_boundary():
    rec = SchedulerStats(num_running=1, grammar_cache_bytes=12345, grammar_cache_evictions=3)
    back = MsgpackDecoder(SchedulerStats).decode(MsgpackEncoder().encode(rec))
    assert (back.grammar_cache_bytes, back.grammar_cache_evictions) == (12345, 3)
    both = combine([rec, SchedulerStats(grammar_cache_bytes=5, grammar_cache_evictions=1)])
    assert (both.grammar_cache_bytes, both.grammar_cache_evictions) == (12350, 4)


def test_metrics_report_grammar_cache_and_memory(tiny_path):
    from fastapi.testclient import TestClient
    from transformers import AutoConfig

    from vllite_core.entrypoints.openai.api_server import build_app

    args = EngineArgs.from_kwargs(model=tiny_path, dtype="float32", num_kv_blocks=96,
                                  structured_outputs_config={"backend": "xgrammar",
                                                             "grammar_cache_bytes": GRAMMAR_BOUND})
    allm = AsyncLLM(LLMEngine.from_engine_args(args))
    try:
        manager = allm.engine.core.engine_core.structured_output

        async def run(i: int) -> None:
            regex = "(" + "|".join(f"k{i}x{j}" for j in range(2000)) + ")"
            params = SamplingParams(max_tokens=2, temperature=0.0, structured_outputs=StructuredOutputsParams(
                regex=regex))
            async for _ in allm.generate({"prompt_token_ids": [5, 6, 7]}, params, f"g{i}"):
                pass

        async def main():
            for i in range(6):
                await run(i)
            async for _ in allm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=1), "fresh"):
                pass  # a fresh step: the statistics /metrics reads come after the last compile
        asyncio.run(main())
        with TestClient(build_app(allm, ["tiny"])) as client:
            text = client.get("/metrics").text
        cached = metric(text, "vllite:grammar_cache_bytes")
        assert 0 < cached <= GRAMMAR_BOUND
        assert cached == manager.cache_bytes
        assert metric(text, "vllite:grammar_cache_evictions_total") == manager.num_cache_evictions > 0

        hf = AutoConfig.from_pretrained(tiny_path)
        kv = 96 * kv_bytes_per_block(hf, 16)
        assert metric(text, "vllite:engine_memory_bytes", part="kv_cache") == kv
        params = sum(p.numel() * 4 for p in _hf_model(tiny_path).parameters())
        assert metric(text, "vllite:engine_memory_bytes", part="weights") >= params
        resident = metric(text, "vllite:engine_memory_bytes", part="resident")
        assert metric(text, "vllite:engine_memory_bytes", part="planned") == resident + kv
        assert metric(text, "vllite:engine_resident_bytes") > 0
    finally:
        allm.close()


def _hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path)


def vm_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.slow
def test_commit_kv_cache_makes_the_footprint_fixed(tiny_path):
    """The same engine core with and without commit_kv_cache: its RSS differs by at least the cache's size
    (less the pages the plain one touched already), and the plain one's report predicted the committed RSS."""
    from transformers import AutoConfig

    from vllite_core.engine.mp_client import MPClient

    blocks = 32768  # 256 MiB of cache for this model
    kv = blocks * kv_bytes_per_block(AutoConfig.from_pretrained(tiny_path), 16)
    rss, reports = {}, {}
    for commit in (False, True):
        args = EngineArgs.from_kwargs(model=tiny_path, dtype="float32", num_kv_blocks=blocks, commit_kv_cache=commit)
        client = MPClient(args.create_config())
        try:
            rss[commit] = vm_rss(client.engines[0].pid)
            reports[commit] = client.info.memory
        finally:
            client.close()
    assert reports[False].kv_cache_bytes == reports[True].kv_cache_bytes == kv
    assert reports[True].kv_committed and not reports[False].kv_committed
    grew = rss[True] - rss[False]
    print(f"core RSS: {rss[False] / 2**20:.0f} MiB plain, {rss[True] / 2**20:.0f} MiB committed "
          f"(+{grew / 2**20:.0f} MiB; cache {kv / 2**20:.0f} MiB); plain report planned "
          f"{reports[False].planned_bytes / 2**20:.0f} MiB")
    assert grew >= kv - (8 << 20)  # a few 2 MiB huge pages the plain core touched while starting
    assert abs(reports[False].planned_bytes - rss[True]) <= 0.05 * rss[True]
    assert reports[True].planned_bytes == reports[True].resident_bytes
