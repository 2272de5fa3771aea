#!/usr/bin/env python3
"""The server with its engine core in-process vs in its own process (issue 26), one run each.

`vllite serve` (SmolLM2-135M, the default model) in a subprocess, N concurrent streaming
completions (default 64) from an httpx client here. Reported per mode: output tokens/s,
CPU seconds per output token of the API process's asyncio thread (from /metrics
vllite:thread_cpu_seconds{role="api"}), of the whole API process, and of the engine-core
process (own-process mode), all from psutil / the server's own counters over the run only;
then the ratios own/in-process. On a loaded, shared machine wall times are noisy: CPU seconds
are the more robust number.

    .venv/bin/python benchmarks/engine_process.py [--streams 64] [--output-len 32]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
import psutil  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from server_harness import ServerProcess  # noqa: E402

_RANK = re.compile(r"DP rank \d+ pid (\d+)")


def api_thread_cpu(url: str) -> float:
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in fam.samples:
            if s.name.startswith("vllite:thread_cpu_seconds") and s.labels.get("role") == "api":
                return s.value
    return 0.0


def cpu(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


async def stream_all(url: str, n: int, out_len: int) -> int:
    limits = httpx.Limits(max_connections=n + 4)
    async with httpx.AsyncClient(timeout=900, limits=limits) as c:
        async def one(i: int) -> int:
            tokens = 0
            body = {"prompt": f"Request {i}: write a long story about a lighthouse keeper.", "max_tokens": out_len,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            async with c.stream("POST", url + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        tokens += 1 if json.loads(line[6:])["choices"] else 0
            return tokens
        return sum(await asyncio.gather(*[one(i) for i in range(n)]))


def run(mode: str, args: argparse.Namespace) -> dict[str, float]:
    env = {"VLLITE_ENABLE_V1_MULTIPROCESSING": "1" if mode == "own_process" else "0"}
    srv = ServerProcess(["--max-num-seqs", str(args.streams), "--num-threads", str(args.threads),
                         "--max-model-len", "512"], env=env)
    try:
        url = srv.wait_ready(timeout=600)
        engine_pids = [int(p) for p in _RANK.findall(srv.output)]
        asyncio.run(stream_all(url, 4, 4))  # warm-up
        api0, proc0 = api_thread_cpu(url), cpu(srv.proc.pid)
        eng0 = sum(cpu(p) for p in engine_pids)
        t0 = time.perf_counter()
        tokens = asyncio.run(stream_all(url, args.streams, args.output_len))
        wall = time.perf_counter() - t0
        api, proc = api_thread_cpu(url) - api0, cpu(srv.proc.pid) - proc0
        eng = sum(cpu(p) for p in engine_pids) - eng0
    finally:
        srv.stop()
    return {"output_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "api_thread_cpu_s_per_token": api / tokens, "api_process_cpu_s_per_token": proc / tokens,
            "engine_process_cpu_s_per_token": eng / tokens if engine_pids else 0.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    res = {mode: run(mode, args) for mode in ("in_process", "own_process")}
    a, b = res["in_process"], res["own_process"]
    res["ratio_own_over_in"] = {k: (b[k] / a[k] if a[k] else None) for k in
                                ("tokens_per_s", "api_thread_cpu_s_per_token", "api_process_cpu_s_per_token")}
    res["note"] = (f"one run each, {args.streams} concurrent streams x {args.output_len} tokens, on "
                   f"{os.cpu_count()} cores shared with other jobs (loaded machine: wall times are noisy)")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
