"""Schemathesis against a real `vllite serve`, from the server's own /openapi.json.

    python benchmarks/fuzz_server.py [--cases 500] [--model PATH] [--url http://127.0.0.1:PORT]
                                     [--seed 0] [--max-tokens 4] [--json out.json]

Without ``--url`` it starts ``vllite serve`` on 127.0.0.1 (benchmarks/soak.py's Server). For each
of /v1/completions, /v1/chat/completions, /tokenize, /detokenize it sends ``--cases`` generated
bodies (half valid for the schema, half not), and for the valid ones the same body again with a
prompt the model can take (so that the sampling fields reach the engine), plus raw bodies with
integers past int64 and the NaN / Infinity literals in every number field. Generated max_tokens
above ``--max-tokens`` are lowered to it, n above 4 to 4 (out-of-range values go as generated).
Reports cases run and status-code counts per route; then a normal request must succeed and every
KV block be free (``/metrics``). Exit status 1 on any 5xx, a failed final request or blocks held.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hypothesis_seed
from schemathesis.generation import GenerationMode

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.join(_HERE, "..", "tests")]
from server_harness import ServerProcess  # noqa: E402
from soak import metrics, wait_idle  # noqa: E402

ROUTES = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
LITERALS = [str(2 ** 63), str(2 ** 64), str(-(2 ** 63) - 1), "NaN", "Infinity", "-Infinity", "1e400"]
NUMBER_FIELDS = ["seed", "top_k", "temperature", "max_tokens", "n", "top_p", "priority", "min_tokens", "min_p",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "prompt_logprobs"]


def bounded(body: Any, max_tokens: int) -> Any:
    if not isinstance(body, dict):
        return body
    body = dict(body)
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and max_tokens < v < 2 ** 63:
            body[key] = max_tokens
    if "messages" in body and "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = max_tokens
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and 4 < n <= 128:
        body["n"] = 4
    return body


def repaired(body: Any) -> Any:
    if not isinstance(body, dict):
        return None
    body = dict(body)
    body.pop("model", None)
    if "prompt" in body:
        body["prompt"] = "The capital of France is"
    if "messages" in body:
        body["messages"] = [{"role": "user", "content": "Hello"}]
        body.pop("chat_template", None)
        body.pop("chat_template_kwargs", None)
    if "tokens" in body:
        body["tokens"] = [t for t in body["tokens"] if isinstance(t, int) and 0 <= t < 1000] or [3]
    return body


class Fuzzer:
    def __init__(self, url: str, api_key: str | None) -> None:
        headers = {"Content-Type": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self.client = httpx.Client(base_url=url, headers=headers, timeout=300)
        self.counts: dict[str, dict[str, int]] = {}
        self.failures: list[str] = []
        self.cases = 0

    def post_raw(self, path: str, raw: str | bytes) -> int:
        try:
            r = self.client.post(path, content=raw)
            status = r.status_code
        except httpx.HTTPError as e:
            status, r = -1, None
            self.failures.append(f"{path} {type(e).__name__}: {e}: {str(raw)[:300]}")
        per = self.counts.setdefault(path, {})
        per[str(status)] = per.get(str(status), 0) + 1
        self.cases += 1
        if status >= 500 and len(self.failures) < 20:
            self.failures.append(f"{path} {status}: {str(raw)[:500]} -> {r.text[:500] if r is not None else ''}")
        return status

    def post(self, path: str, body: Any) -> int:
        raw = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True, default=str)
        return self.post_raw(path, raw)


def make_runner(fz: Fuzzer, schema: Any, path: str, mode: GenerationMode, a: argparse.Namespace) -> Any:
    @hypothesis_seed(a.seed)
    @settings(max_examples=max(1, a.cases // 2), deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=schema[path]["POST"].as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        body = bounded(case.body if case.body is not None else {}, a.max_tokens)
        fz.post(path, body)
        fixed = repaired(body) if mode == GenerationMode.POSITIVE else None
        if fixed is not None:
            fz.post(path, fixed)

    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url")
    ap.add_argument("--model")
    ap.add_argument("--cases", type=int, default=500, help="generated bodies per route (half valid, half not)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--api-key")
    ap.add_argument("--server-arg", action="append", default=[])
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    server = None
    url = a.url
    if url is None:
        server = ServerProcess(([a.model] if a.model else []) + ["--scheduling-policy", "priority", *a.server_arg])
        url = server.wait_ready(600)
    t0 = time.monotonic()
    fz = Fuzzer(url, a.api_key)
    try:
        schema = schemathesis.openapi.from_dict(fz.client.get("/openapi.json").json())
        for path in ROUTES:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                make_runner(fz, schema, path, mode, a)()
                print(f"{path} {mode}: {fz.counts.get(path)}", file=sys.stderr, flush=True)
        for path, base in (("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                     "max_tokens": 2})):
            for fld in NUMBER_FIELDS + (["logprobs"] if path == "/v1/completions" else ["top_logprobs"]):
                for lit in LITERALS:
                    raw = json.dumps({**base, fld: "@@"}).replace('"@@"', lit)
                    if fz.post_raw(path, raw) != 400:
                        fz.failures.append(f"not a 400: {path} {raw}")
        for lit in LITERALS:
            fz.post_raw("/detokenize", '{"tokens": [3, %s]}' % lit)
            fz.post_raw("/v1/completions", '{"prompt": [3, %s], "max_tokens": 1}' % lit)
        final = fz.client.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 4})
        m = wait_idle(url)
        report = {
            "cases": fz.cases, "wall_s": round(time.monotonic() - t0, 1), "status_counts": fz.counts,
            "5xx": sum(v for per in fz.counts.values() for k, v in per.items() if k.startswith("5") or k == "-1"),
            "final_request_status": final.status_code,
            "kv_free_blocks": m.get("vllite:kv_cache_free_blocks"),
            "kv_total_blocks": m.get("vllite:kv_cache_total_blocks"),
            "failures": fz.failures,
        }
        report["ok"] = (report["5xx"] == 0 and not fz.failures and final.status_code == 200
                        and report["kv_total_blocks"] is not None
                        and report["kv_free_blocks"] == report["kv_total_blocks"])
        report["metrics_in_flight"] = metrics(url).get("vllite:num_requests_in_flight")
    finally:
        if server is not None:
            print(f"server exit status: {server.stop()}", file=sys.stderr)
    print(json.dumps(report, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
