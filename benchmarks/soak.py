"""Soak test for `vllite serve`: many mixed requests under KV pressure, then count what went wrong.

    python benchmarks/soak.py [--requests 1000] [--concurrency 16] [--num-gpu-blocks-override 48]
                              [--model PATH] [--url http://127.0.0.1:PORT --pid PID] [--json out.json]

Without ``--url`` it starts ``vllite serve`` on 127.0.0.1 (a free port, ``--scheduling-policy
priority``, ``--num-gpu-blocks-override`` small so requests preempt each other) and stops it at
the end. The mix (seeded): completions and chat, streaming and not, ``n`` 1-3, logprobs, stop
strings, priorities, ``ignore_eos``; 10 % of the requests are aborted by the client (cancelled
after a random delay), 5 % are streams whose client disconnects after the first chunks.

With ``--attacks F`` a fraction F of the requests are issue 58's attacks, each of which must be
refused with a 400 (anything else counts as lost): a chat template looping 10^10 times or building
a 1.5 GB string (the started server gets ``--trust-request-chat-template``), a JSON schema nested
900 deep, a 5,000-entry enum, ``max_tokens`` past the context, /detokenize of 100k ids. A canary
(/health and a 1-token completion every 0.2 s) runs through the whole soak: its worst and p99
latency and failures are reported, and so is the count of 5xx answers.

Reported: lost requests (a request that should have completed and did not: an exception, a
status other than 200, a stream without ``[DONE]``, a wrong number of choices), hung ones (no
answer within ``--request-timeout-s``), whether every KV block is free at the end (``/metrics``:
``vllite:kv_cache_free_blocks`` == ``vllite:kv_cache_total_blocks``, nothing in flight), the
server's resident memory after a warm-up and at the end, and p50 / p99 latency of the completed
requests. Exit status 1 when anything was lost or hung or blocks were not returned.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from canary import Canary  # noqa: E402
from server_harness import ServerProcess  # noqa: E402

WORDS = ["in the", "of the", "and then", "a story", "the river", "once upon a time", "she said", "it was"]


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def metrics(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("vllite:"):
            key, _, value = line.rpartition(" ")
            name = key.split("{", 1)[0]
            if "{" in key and name in out:  # a labelled counter: sum its series
                try:
                    out[name] += float(value)
                except ValueError:
                    pass
                continue
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


@dataclass
class Plan:
    i: int
    route: str
    body: dict[str, Any]
    behaviour: str  # "normal" | "abort" | "disconnect" | "attack" (must be a 400)
    abort_after_s: float = 0.0


@dataclass
class Result:
    planned: int = 0
    completed: int = 0
    aborted_by_client: int = 0
    disconnected: int = 0
    lost: int = 0
    hung: int = 0
    refused_attacks: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    lost_examples: list[str] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)


ATTACKS: dict[str, tuple[str, dict[str, Any]]] = {
    "hanging_template": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "chat_template": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"}),
    "bloating_template": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "chat_template": "{{ 'x' * 1500000000 }}"}),
    "deep_schema": ("/v1/completions", {"prompt": [3, 4], "max_tokens": 2,
                                        "guided_json": '{"default": ' + "[" * 900 + "]" * 900 + "}"}),
    "huge_enum": ("/v1/completions", {"prompt": [3, 4], "max_tokens": 2,
                                      "guided_json": {"enum": [f"e{i}" for i in range(5000)]}}),
    "max_tokens_past_context": ("/v1/completions", {"prompt": [3, 4], "max_tokens": 10 ** 9}),
    "detokenize_100k": ("/detokenize", {"tokens": [3] * 100_000}),
}


def make_plan(i: int, rng: random.Random, *, priority: bool, chat_template: str | None, vocab: int,
              max_tokens: int, words: list[str], abort_within_s: float = 1.5, attacks: float = 0.0) -> Plan:
    if attacks and rng.random() < attacks:
        name = rng.choice(sorted(ATTACKS))
        route, body = ATTACKS[name]
        return Plan(i, route, {**body, "attack": name}, "attack")
    stream = rng.random() < 0.5
    n = rng.choice([1, 1, 1, 2, 3])
    body: dict[str, Any] = {"max_tokens": rng.randint(2, max_tokens), "n": n, "stream": stream,
                            "temperature": rng.choice([0.0, 0.7, 1.0]), "seed": rng.randint(0, 2 ** 31)}
    if rng.random() < 0.3:
        body["stop"] = rng.sample([" the", ".", "\n", "and", "e"], rng.randint(1, 2))
    if rng.random() < 0.3:
        body["ignore_eos"] = True
    if priority:
        body["priority"] = rng.randint(-5, 5)
    if stream and rng.random() < 0.3:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.5:
        route = "/v1/completions"
        if rng.random() < 0.5:
            body["prompt"] = [rng.randint(1, vocab - 1) for _ in range(rng.randint(3, 40))]
        else:
            body["prompt"] = " ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
        if rng.random() < 0.3:
            body["logprobs"] = rng.randint(0, 3)
        if rng.random() < 0.1:
            body["echo"] = True
    else:
        route = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": " ".join(rng.choice(words) for _ in range(rng.randint(1, 10)))}]
        if chat_template:
            body["chat_template"] = chat_template
        if rng.random() < 0.3:
            body["logprobs"] = True
            body["top_logprobs"] = rng.randint(0, 3)
    r = rng.random()
    if r < 0.10:
        body["max_tokens"], body["ignore_eos"] = max_tokens, True  # still running when the client gives up
        return Plan(i, route, body, "abort", rng.uniform(0.0, abort_within_s))
    if r < 0.15:
        body["stream"] = True
        body["max_tokens"] = max(body["max_tokens"], 8)
        return Plan(i, route, body, "disconnect")
    return Plan(i, route, body, "normal")


async def run_one(client: httpx.AsyncClient, plan: Plan, res: Result, timeout_s: float) -> None:
    t0 = time.monotonic()

    def lost(why: str) -> None:
        res.lost += 1
        if len(res.lost_examples) < 10:
            res.lost_examples.append(f"#{plan.i} {plan.route} {why}: {json.dumps(plan.body)[:300]}")

    async def normal() -> None:
        n = plan.body["n"]
        if plan.body["stream"]:
            async with client.stream("POST", plan.route, json=plan.body) as r:
                res.statuses[str(r.status_code)] = res.statuses.get(str(r.status_code), 0) + 1
                if r.status_code != 200:
                    lost(f"status {r.status_code}: {(await r.aread())[:300]!r}")
                    return
                done, finished, err = False, set(), None
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        done = True
                        continue
                    ev = json.loads(data)
                    if "error" in ev:
                        err = ev["error"]
                    for c in ev.get("choices", []):
                        if c.get("finish_reason"):
                            finished.add(c["index"])
                if not done or err is not None or len(finished) != n:
                    lost(f"stream done={done} error={err} finished={len(finished)}/{n}")
                    return
        else:
            r = await client.post(plan.route, json=plan.body)
            res.statuses[str(r.status_code)] = res.statuses.get(str(r.status_code), 0) + 1
            if r.status_code != 200:
                lost(f"status {r.status_code}: {r.text[:300]}")
                return
            choices = r.json().get("choices", [])
            if len(choices) != n or not all(c.get("finish_reason") for c in choices):
                lost(f"{len(choices)} choices for n={n}")
                return
        res.completed += 1
        res.latencies_s.append(time.monotonic() - t0)

    async def abort() -> None:
        try:
            await asyncio.wait_for(normal(), plan.abort_after_s)
        except asyncio.TimeoutError:
            res.aborted_by_client += 1
            return

    async def disconnect() -> None:
        async with client.stream("POST", plan.route, json=plan.body) as r:
            res.statuses[str(r.status_code)] = res.statuses.get(str(r.status_code), 0) + 1
            if r.status_code != 200:
                lost(f"status {r.status_code}")
                return
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen >= 2:
                        break
        res.disconnected += 1  # leaving the block closes the connection mid-stream

    async def attack() -> None:
        body = {k: v for k, v in plan.body.items() if k != "attack"}
        r = await client.post(plan.route, json=body)
        res.statuses[str(r.status_code)] = res.statuses.get(str(r.status_code), 0) + 1
        if r.status_code != 400:
            lost(f"attack {plan.body['attack']}: status {r.status_code}: {r.text[:200]}")
            return
        res.refused_attacks += 1

    work = {"normal": normal, "abort": abort, "disconnect": disconnect, "attack": attack}[plan.behaviour]
    try:
        await asyncio.wait_for(work(), timeout_s)
    except asyncio.TimeoutError:
        res.hung += 1
        if len(res.lost_examples) < 10:
            res.lost_examples.append(f"#{plan.i} hung: {json.dumps(plan.body)[:300]}")
    except Exception as e:  # noqa: BLE001 - every failure counts as lost
        lost(f"{type(e).__name__}: {e}")


async def run_plans(url: str, plans: list[Plan], concurrency: int, timeout_s: float, api_key: str | None,
                    res: Result) -> None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(timeout_s + 30), limits=limits,
                                 headers=headers) as client:
        async def guarded(p: Plan) -> None:
            async with sem:
                await run_one(client, p, res, timeout_s)

        res.planned += len(plans)
        await asyncio.gather(*(guarded(p) for p in plans))


def wait_idle(url: str, timeout_s: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    m = metrics(url)
    while time.monotonic() < deadline:
        m = metrics(url)
        if (m.get("vllite:num_requests_in_flight", 0) == 0 and m.get("vllite:num_requests_running", 0) == 0
                and m.get("vllite:num_requests_waiting", 0) == 0
                and m.get("vllite:kv_cache_free_blocks") == m.get("vllite:kv_cache_total_blocks")):
            return m
        time.sleep(0.25)
    return m


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def soak(url: str, pid: int | None, *, requests: int, warmup: int, concurrency: int, seed: int,
         priority: bool, chat_template: str | None, vocab: int, max_tokens: int, timeout_s: float,
         api_key: str | None = None, words: list[str] | None = None, abort_within_s: float = 1.5,
         attacks: float = 0.0) -> dict[str, Any]:
    """``words``: the text prompts are made of these (default WORDS); an aborted request is
    cancelled by its client after a uniform random delay in [0, ``abort_within_s``]; ``attacks``:
    the fraction of the (post-warm-up) requests that are ATTACKS."""
    rng = random.Random(seed)
    kw = dict(priority=priority, chat_template=chat_template, vocab=vocab, max_tokens=max_tokens,
              words=words or WORDS, abort_within_s=abort_within_s)
    warm = [make_plan(-1 - i, rng, **kw) for i in range(warmup)]
    plans = [make_plan(i, rng, **kw, attacks=attacks) for i in range(requests)]
    warm_res = Result()
    asyncio.run(run_plans(url, warm, concurrency, timeout_s, api_key, warm_res))
    wait_idle(url)
    rss_before = rss_mb(pid)
    res = Result()
    t0 = time.monotonic()
    trend = []  # the server's RSS after each quarter of the requests: a leak grows, a warm-up levels off
    step = max(1, -(-len(plans) // 4))
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with Canary(url, prompt=[3, 4, 5], headers=headers) as canary:
        for k in range(0, len(plans), step):
            asyncio.run(run_plans(url, plans[k:k + step], concurrency, timeout_s, api_key, res))
            r = rss_mb(pid)
            trend.append(None if r is None else round(r, 1))
    wall = time.monotonic() - t0
    m = wait_idle(url)
    rss_after = rss_mb(pid)
    blocks_back = (m.get("vllite:kv_cache_total_blocks") is not None
                   and m.get("vllite:kv_cache_free_blocks") == m.get("vllite:kv_cache_total_blocks")
                   and m.get("vllite:num_requests_in_flight", 0) == 0)
    healthy = httpx.get(url + "/health", timeout=30).status_code == 200
    out = asdict(res)
    lat = out.pop("latencies_s")
    out.update(
        warmup=warmup, warmup_lost=warm_res.lost + warm_res.hung, wall_s=round(wall, 1),
        kv_free_blocks=m.get("vllite:kv_cache_free_blocks"), kv_total_blocks=m.get("vllite:kv_cache_total_blocks"),
        blocks_back=blocks_back, healthy_after=healthy,
        preemptions=m.get("vllite:num_preemptions_total"),
        rss_mb_after_warmup=None if rss_before is None else round(rss_before, 1),
        rss_mb_end=None if rss_after is None else round(rss_after, 1),
        rss_mb_per_quarter=trend,
        rss_growth_mb=None if rss_before is None or rss_after is None else round(rss_after - rss_before, 1),
        latency_p50_s=None if not lat else round(percentile(lat, 50), 3),
        latency_p99_s=None if not lat else round(percentile(lat, 99), 3),
        five_xx=sum(n for code, n in res.statuses.items() if code.startswith("5")),
        canary_probes=len(canary.report.health_s) + len(canary.report.completion_s),
        canary_worst_s=round(canary.report.worst_s, 3), canary_p99_s=round(canary.report.p99_s(), 3),
        canary_failures=canary.report.failures[:5],
        ok=res.lost == 0 and res.hung == 0 and blocks_back and healthy and not canary.report.failures,
    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running server (else one is started); give --pid for its memory")
    ap.add_argument("--pid", type=int, help="the server's process id (with --url)")
    ap.add_argument("--model", help="model for the started server (default: the embedded SmolLM2-135M)")
    ap.add_argument("--num-gpu-blocks-override", type=int, default=48, help="KV blocks of the started server")
    ap.add_argument("--server-arg", action="append", default=[], help="extra `vllite serve` argument (repeatable)")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--vocab", type=int, default=49152, help="token ids in prompts are below this")
    ap.add_argument("--chat-template", help="send this chat_template with chat requests")
    ap.add_argument("--attacks", type=float, default=0.0, help="fraction of requests that are attacks (must be 400)")
    ap.add_argument("--no-priority", action="store_true", help="the server runs fcfs: send no priorities")
    ap.add_argument("--request-timeout-s", type=float, default=300.0, help="a request past this is hung")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--api-key")
    ap.add_argument("--json", help="write the report here as JSON")
    a = ap.parse_args(argv)
    server = None
    url, pid = a.url, a.pid
    if url is None:
        args = ([a.model] if a.model else []) + ["--num-gpu-blocks-override", str(a.num_gpu_blocks_override)]
        if not a.no_priority:
            args += ["--scheduling-policy", "priority"]
        if a.chat_template or a.attacks:
            args += ["--trust-request-chat-template"]
        server = ServerProcess(args + list(a.server_arg))
        url, pid = server.wait_ready(600), server.proc.pid
    try:
        report = soak(url, pid, requests=a.requests, warmup=a.warmup, concurrency=a.concurrency, seed=a.seed,
                      priority=not a.no_priority, chat_template=a.chat_template, vocab=a.vocab,
                      max_tokens=a.max_tokens, timeout_s=a.request_timeout_s, api_key=a.api_key, attacks=a.attacks)
    finally:
        if server is not None:
            rc = server.stop()
            print(f"server exit status: {rc}", file=sys.stderr)
    print(json.dumps(report, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
