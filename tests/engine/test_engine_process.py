"""The server's engine core in its own process (issue 26): `vllite serve` on a tiny random Llama,
queried with the real `openai` client.

- kill -9 of the engine-core process mid-stream: every open stream ends with an error naming the
  signal, /health turns 503 (naming it too), a new request is refused, nothing hangs;
- a start-up failure in the engine process (a model path that does not exist) makes the server exit
  non-zero with the engine's own error text;
- --data-parallel-size 2: a batch of greedy requests gives the offline (in-process) engine's tokens,
  and both engine cores got work (their own `vllm:` samples, engine label "0" and "1").
"""
from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import ServerProcess

from vllite_core import LLM, SamplingParams

pytestmark = pytest.mark.slow

ENGINE = ["--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "256", "--num-threads", "1"]
_LAYOUT = re.compile(r"process layout: API server pid (\d+); (\d+) engine core process")
_RANK = re.compile(r"DP rank (\d+) pid (\d+)")


def engine_pids(srv: ServerProcess) -> dict[int, int]:
    line = next(ln for ln in srv.lines if _LAYOUT.search(ln))
    assert int(_LAYOUT.search(line).group(1)) == srv.proc.pid
    return {int(r): int(p) for r, p in _RANK.findall(line)}


def start(args: list[str], **env: str) -> tuple[ServerProcess, str]:
    srv = ServerProcess(args, env={"VLLITE_ENABLE_V1_MULTIPROCESSING": "1", **env})
    return srv, srv.wait_ready(timeout=240)


def test_killing_the_engine_fails_every_open_stream_and_health(tiny_path):
    # restarts off: the engine stays dead (tests/engine/test_core_restart.py has one that comes back)
    srv, url = start(["--model", tiny_path, *ENGINE, "--engine-restart-max", "0"],
                     VLLITE_KEEP_ALIVE_ON_ENGINE_DEATH="1")
    try:
        pids = engine_pids(srv)
        assert list(pids) == [0] and pids[0] != srv.proc.pid
        n_streams = 4

        async def main() -> list[BaseException | None]:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
            started = asyncio.Event()
            count = [0]

            async def one(i: int) -> BaseException | None:
                try:
                    # Counted as soon as the server answers (it queued the request before that), not at the
                    # first chunk: under the full suite, waiting for every stream's first chunk once let the
                    # first stream finish before the kill.
                    stream = await client.completions.create(
                        model=tiny_path, prompt=[5 + i, 6, 7], max_tokens=250, temperature=0.0, stream=True,
                        extra_body={"ignore_eos": True})
                    count[0] += 1
                    if count[0] == n_streams:
                        started.set()
                    async for _ in stream:
                        pass
                    return None  # ended without an error: the test fails below
                except Exception as e:
                    return e

            tasks = [asyncio.create_task(one(i)) for i in range(n_streams)]
            await asyncio.wait_for(started.wait(), 120)
            os.kill(pids[0], signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*tasks), 30)  # nothing hangs
            await client.close()
            return results

        errors = asyncio.run(main())
        assert all(isinstance(e, openai.APIError) for e in errors), errors
        assert all("SIGKILL" in str(e) for e in errors), errors
        deadline = time.monotonic() + 10
        while (health := httpx.get(url + "/health", timeout=5)).status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert health.status_code == 503 and "SIGKILL" in health.text
        again = httpx.post(url + "/v1/completions", json={"model": tiny_path, "prompt": [5, 6], "max_tokens": 2},
                           timeout=30)
        assert again.status_code == 503 and "SIGKILL" in again.text
    finally:
        srv.stop()


def test_engine_startup_failure_is_reported_with_its_text():
    srv = ServerProcess(["--model", "/nonexistent/vllite-model", "--dtype", "float32"],
                        env={"VLLITE_ENABLE_V1_MULTIPROCESSING": "1"})
    rc = srv.proc.wait(timeout=240)
    srv._reader.join(10)
    assert rc != 0
    out = srv.output
    assert "vllite serve: the engine failed to start: ModelNotFoundError" in out, out
    assert "'/nonexistent/vllite-model' not found" in out


def _samples(url: str, name: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                out[s.labels["engine"]] = s.value
    return out


def test_data_parallel_two_engines_match_one_and_share_the_work(tiny_path):
    srv, url = start(["--model", tiny_path, *ENGINE, "--data-parallel-size", "2"])
    try:
        pids = engine_pids(srv)
        assert sorted(pids) == [0, 1] and len(set(pids.values())) == 2
        prompts = [[(7 * i + 3 * j) % 400 + 2 for j in range(4 + i)] for i in range(8)]
        ref = LLM(model=tiny_path, dtype="float32", num_kv_blocks=64, max_model_len=256).generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))

        async def main() -> list[str]:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
            outs = await asyncio.gather(*[client.completions.create(
                model=tiny_path, prompt=p, max_tokens=12, temperature=0.0, extra_body={"ignore_eos": True})
                for p in prompts])
            await client.close()
            return [o.choices[0].text for o in outs]

        texts = asyncio.run(main())
        assert texts == [r.outputs[0].text for r in ref]
        queries = _samples(url, "vllm:prefix_cache_queries_total")
        assert set(queries) == {"0", "1"} and all(v > 0 for v in queries.values()), queries
        _prefix_affinity_beats_the_idle_engine(url, tiny_path)
    finally:
        srv.stop()


def _prefix_affinity_beats_the_idle_engine(url: str, model: str) -> None:
    """With both cores idle the least loaded is engine 0: it serves a prompt with a 3-block prefix, then a
    long request. While that one runs, a prompt sharing the prefix still goes to engine 0 (its blocks are
    cached there: hits), and the same prompt under another cache_salt to the idle engine 1 (no hits)."""
    prefix = [(11 * j) % 300 + 5 for j in range(48)]
    body = {"max_tokens": 2, "temperature": 0.0}
    httpx.post(url + "/v1/completions", json={"model": model, "prompt": prefix + [9, 8], **body},
               timeout=60).raise_for_status()
    hits = _samples(url, "vllm:prefix_cache_hits_total")

    async def main() -> None:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        long = await client.completions.create(model=model, prompt=[3, 4, 5], max_tokens=230, temperature=0.0,
                                               stream=True, extra_body={"ignore_eos": True})
        async for _ in long:  # its first token: it runs on engine 0 now
            break
        await asyncio.gather(*[client.completions.create(model=model, prompt=prefix + [7, 6], extra_body=extra,
                                                         **body) for extra in ({}, {"cache_salt": "tenant-b"})])
        async for _ in long:
            pass
        await client.close()

    asyncio.run(main())
    after = _samples(url, "vllm:prefix_cache_hits_total")
    assert after["0"] - hits["0"] == 48 and after["1"] == hits["1"], (hits, after)
