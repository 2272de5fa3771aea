#!/usr/bin/env python3
"""What the HTTP/API layer costs, and whether it stalls the model loop.

Same engine settings, same workload, two ways:
  offline  LLM.generate in this process (no API layer at all);
  server   `vllite serve` in a subprocess, N concurrent streaming requests from a
           light httpx client here.
Reported: wall time and tokens/s of each; the server's engine-loop split
(step = LLMEngine.step, other = the loop's own inbox/hand-off work) from /metrics;
mean step time offline vs served (a stalled loop shows up as longer or fewer
steps); CPU seconds of the server's API (asyncio) thread per request and per
streamed token, and the whole process's CPU seconds served vs offline (robust
on a shared machine, where wall times are not); and the latency of a 1-token
request, HTTP vs offline.

    .venv/bin/python benchmarks/serve_overhead.py [--requests 32] [--output-len 64]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from server_harness import ServerProcess  # noqa: E402


def scrape(url: str) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in fam.samples:
            extra = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{extra}}}" if extra else "")] = s.value
    return out


def prompts(n: int) -> list[str]:
    return [f"Request {i}: write a long story about a lighthouse keeper and the sea." for i in range(n)]


async def stream_all(url: str, ps: list[str], out_len: int) -> int:
    chunks = 0
    limits = httpx.Limits(max_connections=len(ps) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as c:
        async def one(p: str) -> int:
            n = 0
            body = {"prompt": p, "max_tokens": out_len, "temperature": 0, "ignore_eos": True, "stream": True}
            async with c.stream("POST", url + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        n += 1
            return n
        chunks = sum(await asyncio.gather(*(one(p) for p in ps)))
    return chunks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--latency-runs", type=int, default=10)
    a = ap.parse_args()
    engine = dict(dtype="float32", max_model_len=1024, num_kv_blocks=256, max_num_seqs=max(a.requests, 16),
                  num_threads=a.threads)
    cli = []
    for k, v in engine.items():
        cli += ["--" + k.replace("_", "-"), str(v)]

    srv = ServerProcess(cli)  # loads while nothing else runs here
    url = srv.wait_ready()
    ps = prompts(a.requests)
    tokens = a.requests * a.output_len
    stream_all_run = lambda: asyncio.run(stream_all(url, ps, a.output_len))  # noqa: E731
    stream_all_run()  # warm-up
    m0 = scrape(url)
    t0 = time.perf_counter()
    chunks = stream_all_run()
    served_wall = time.perf_counter() - t0
    m1 = scrape(url)
    lat_http = []
    m2 = scrape(url)
    with httpx.Client(timeout=60) as hc:  # one keep-alive connection: time the server, not connection setup
        for _ in range(a.latency_runs + 1):
            t = time.perf_counter()
            hc.post(url + "/v1/completions", json={"prompt": ps[0], "max_tokens": 1, "temperature": 0})
            lat_http.append(time.perf_counter() - t)
    lat_http = lat_http[1:]
    m3 = scrape(url)
    srv.stop()
    # Per request, alone: the server's own e2e (accepted -> finished) minus the engine steps it took.
    n_lat = m3["vllite:e2e_request_latency_seconds_count"] - m2["vllite:e2e_request_latency_seconds_count"]
    api_path_s = ((m3["vllite:e2e_request_latency_seconds_sum"] - m2["vllite:e2e_request_latency_seconds_sum"])
                  - (m3["vllite:engine_loop_seconds_total{phase=step}"]
                     - m2["vllite:engine_loop_seconds_total{phase=step}"])) / max(n_lat, 1)

    import torch

    torch.set_num_threads(a.threads)
    from vllite_core import LLM, SamplingParams

    llm = LLM(**engine)
    params = SamplingParams(temperature=0.0, max_tokens=a.output_len, ignore_eos=True)
    llm.generate(ps, params)  # warm-up
    timed = {"steps": 0, "s": 0.0}  # LLMEngine.step, the same span the server's loop times
    step = llm.llm_engine.step

    def timed_step(*args, **kw):
        t = time.perf_counter()
        try:
            return step(*args, **kw)
        finally:
            timed["steps"] += 1
            timed["s"] += time.perf_counter() - t

    llm.llm_engine.step = timed_step
    t0, c0 = time.perf_counter(), time.process_time()
    llm.generate(ps, params)
    offline_wall, offline_cpu = time.perf_counter() - t0, time.process_time() - c0
    off_steps, off_step_s = timed["steps"], timed["s"]
    lat_off = []
    for _ in range(a.latency_runs):
        t = time.perf_counter()
        llm.generate(ps[0], SamplingParams(temperature=0.0, max_tokens=1))
        lat_off.append(time.perf_counter() - t)

    def d(key: str) -> float:
        return m1[key] - m0[key]

    steps = d("vllite:engine_loop_steps_total")
    step_s = d("vllite:engine_loop_seconds_total{phase=step}")
    other_s = d("vllite:engine_loop_seconds_total{phase=other}")
    api_cpu = d("vllite:thread_cpu_seconds_total{role=api}")
    report = {
        "workload": f"{a.requests} concurrent streams x {a.output_len} tokens, SmolLM2-135M fp32, "
                    f"{a.threads} torch threads, {os.cpu_count()} cores",
        "offline": {"wall_s": round(offline_wall, 3), "tok_per_s": round(tokens / offline_wall, 1),
                    "steps": off_steps, "mean_step_ms": round(1000 * off_step_s / max(off_steps, 1), 2),
                    "process_cpu_s": round(offline_cpu, 2)},
        "served": {"wall_s": round(served_wall, 3), "tok_per_s": round(tokens / served_wall, 1),
                   "sse_chunks": chunks, "steps": int(steps),
                   "mean_step_ms": round(1000 * step_s / max(steps, 1), 2),
                   "loop_other_ms_per_step": round(1000 * other_s / max(steps, 1), 3),
                   "loop_busy_fraction_in_step": round(step_s / max(step_s + other_s, 1e-9), 4),
                   "api_thread_cpu_s": round(api_cpu, 3),
                   "api_cpu_ms_per_request": round(1000 * api_cpu / a.requests, 2),
                   "api_cpu_us_per_token": round(1e6 * api_cpu / tokens, 1),
                   "engine_thread_cpu_s": round(d("vllite:thread_cpu_seconds_total{role=engine_loop}"), 3),
                   "other_threads_cpu_s": round(d("vllite:thread_cpu_seconds_total{role=other}"), 3),
                   "process_cpu_s": round(sum(d(f"vllite:thread_cpu_seconds_total{{role={r}}}")
                                              for r in ("api", "engine_loop", "other")), 2)},
        "one_token_latency_ms": {"http_median": round(1000 * statistics.median(lat_http), 1),
                                 "offline_median": round(1000 * statistics.median(lat_off), 1),
                                 "server_e2e_minus_steps_mean": round(1000 * api_path_s, 2)},
    }
    report["served_over_offline_wall"] = round(served_wall / offline_wall, 3)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
