"""Serving benchmark: an asyncio + httpx client for an OpenAI-compatible completions server.

Requests go to ``POST {base_url}/v1/completions`` with ``"stream": true`` and
arrive at a Poisson rate (exponential gaps; ``inf`` sends all at once), optionally
capped at a maximum number in flight. Each server-sent ``data:`` chunk that carries
text is one arrival: TTFT is the first, ITL the gaps between arrivals, TPOT
``(e2e - TTFT) / (output tokens - 1)``. Output tokens come from the final usage
chunk when the server sends one (``stream_options.include_usage``), else from the
number of text chunks.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

from vllite_core.benchmarks.datasets import BenchRequest
from vllite_core.benchmarks.report import machine_facts, percentiles


@dataclass
class RequestRecord:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    text: str = ""


def _payload(req: BenchRequest, model: str | None, ignore_eos: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": req.prompt_token_ids if req.prompt_token_ids is not None else req.prompt,
        "max_tokens": req.output_len, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    if ignore_eos:
        body["ignore_eos"] = True
    return body


async def _one(client: Any, url: str, req: BenchRequest, model: str | None, ignore_eos: bool,
               headers: dict[str, str]) -> RequestRecord:
    rec = RequestRecord(prompt_tokens=req.input_len)
    start = time.perf_counter()
    last = start
    chunks = 0
    usage_tokens = None
    try:
        async with client.stream("POST", url, json=_payload(req, model, ignore_eos), headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                rec.error = f"HTTP {resp.status_code}: {body[:200]}"
                return rec
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                usage = obj.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
                    if usage.get("prompt_tokens") is not None:
                        rec.prompt_tokens = int(usage["prompt_tokens"])
                choices = obj.get("choices") or []
                text = "".join(c.get("text") or "" for c in choices)
                has_token = bool(text) or any(c.get("token_ids") for c in choices)
                if not has_token:
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    rec.ttft = now - start
                else:
                    rec.itl.append(now - last)
                last = now
                chunks += 1
                rec.text += text
        rec.e2e = time.perf_counter() - start
        rec.output_tokens = usage_tokens if usage_tokens is not None else chunks
        rec.ok = chunks > 0
        if not rec.ok:
            rec.error = "no tokens streamed"
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        rec.error = f"{type(e).__name__}: {e}"
    return rec


async def _intervals(n: int, rate: float, burstiness: float, seed: int):
    """Yield before each request: sleeps with Poisson (gamma when burstiness != 1) gaps."""
    rng = random.Random(seed)
    for i in range(n):
        yield i
        if rate == float("inf") or i == n - 1:
            continue
        theta = 1.0 / (rate * burstiness)
        await asyncio.sleep(rng.gammavariate(burstiness, theta))


async def run_serve(base_url: str, requests: list[BenchRequest], request_rate: float = float("inf"),
                    max_concurrency: int | None = None, model: str | None = None, ignore_eos: bool = True,
                    seed: int = 0, burstiness: float = 1.0, progress: bool = True, timeout: float = 600.0,
                    api_key: str | None = None) -> dict[str, Any]:
    import httpx

    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency or len(requests) or 1,
                          max_keepalive_connections=max_concurrency or len(requests) or 1)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc="requests", unit="req", dynamic_ncols=True)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        if model is None:
            model = await _first_model(client, base_url, headers)

        async def limited(req: BenchRequest) -> RequestRecord:
            if sem is None:
                rec = await _one(client, url, req, model, ignore_eos, headers)
            else:
                async with sem:
                    rec = await _one(client, url, req, model, ignore_eos, headers)
            if bar is not None:
                bar.update(1)
            return rec

        tasks = []
        start = time.perf_counter()
        async for i in _intervals(len(requests), request_rate, burstiness, seed):
            tasks.append(asyncio.create_task(limited(requests[i])))
        records = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return summarize(records, elapsed, request_rate, max_concurrency, base_url, model)


async def _first_model(client: Any, base_url: str, headers: dict[str, str]) -> str | None:
    try:
        r = await client.get(base_url.rstrip("/") + "/v1/models", headers=headers)
        data = r.json().get("data") or []
        return data[0]["id"] if data else None
    except Exception:  # noqa: BLE001 - servers without /v1/models take requests without a model name
        return None


def summarize(records: list[RequestRecord], elapsed: float, request_rate: float, max_concurrency: int | None,
              base_url: str, model: str | None) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl]
    ms = lambda d: {k: 1e3 * v for k, v in d.items()}  # noqa: E731
    return {
        "bench": "serve", "base_url": base_url, "model": model,
        "request_rate": "inf" if request_rate == float("inf") else request_rate,
        "max_concurrency": max_concurrency,
        "completed": len(ok), "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if not r.ok})[:5],
        "elapsed_s": elapsed,
        "requests_per_s": len(ok) / elapsed if elapsed else 0.0,
        "output_tokens_per_s": out_tokens / elapsed if elapsed else 0.0,
        "total_tokens_per_s": (out_tokens + in_tokens) / elapsed if elapsed else 0.0,
        "prompt_tokens": in_tokens, "output_tokens": out_tokens,
        "ttft_ms": ms(percentiles([r.ttft for r in ok])),
        "tpot_ms": ms(percentiles(tpot)),
        "itl_ms": ms(percentiles(itl)),
        "e2e_ms": ms(percentiles([r.e2e for r in ok])),
        "machine": machine_facts(),
    }
