"""Schemathesis against the server's own OpenAPI schema (/openapi.json, built from the request
models), in process on a tiny random Llama: a bounded, seeded run over /v1/completions,
/v1/chat/completions, /v1/responses, /tokenize and /detokenize (valid and invalid bodies), plus raw-HTTP bodies
with integers past int64 and the NaN / Infinity literals. No case may get a 5xx, and afterwards
the engine still serves and every KV block is free. The longer run against a real `vllite serve`
is benchmarks/fuzz_server.py."""
from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from vllite_core.config import EngineArgs
from vllite_core.engine.async_llm import AsyncLLM
from vllite_core.engine.llm_engine import LLMEngine
from vllite_core.entrypoints.openai.api_server import build_app

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.generation import GenerationMode  # noqa: E402

ENGINE = dict(dtype="float32", num_kv_blocks=64, max_num_batched_tokens=64, scheduling_policy="priority")
ROUTES = ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize"]
CASES_PER_ROUTE_AND_MODE = 60  # x 5 routes x 2 modes = 600 cases
MAX_TOKENS = 3  # cases stay fast: generated max_tokens above this are lowered to it
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # ids within the tiny vocabulary
BIG = ["2**63", "2**64", "-(2**63)-1", "NaN", "Infinity", "-Infinity", "1e400"]
LITERAL = {"2**63": str(2 ** 63), "2**64": str(2 ** 64), "-(2**63)-1": str(-(2 ** 63) - 1)}


@pytest.fixture(scope="module")
def served(tiny_path):
    engine = LLMEngine.from_engine_args(EngineArgs.from_kwargs(model=tiny_path, **ENGINE))
    allm = AsyncLLM(engine)
    app = build_app(allm, ["tiny"], trust_request_chat_template=True)  # the fuzzer sends chat_template
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, allm
    allm.close()


def _bounded(body):
    """Keep generation short: lower max_tokens / max_completion_tokens and n that are valid but big
    (out-of-range values pass untouched: they must be refused), and give chat a max_tokens
    (its default is the whole context)."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and MAX_TOKENS < v < 2 ** 63:
            body[key] = MAX_TOKENS
    if "messages" in body and "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = MAX_TOKENS
    if "input" in body and "max_output_tokens" not in body:
        body["max_output_tokens"] = MAX_TOKENS
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and 4 < n <= 128:
        body["n"] = 4
    return body


def _repaired(body):
    """The same body with a prompt / messages the tiny model can take (the SmolLM2 tokenizer's ids
    are mostly past its 512-token vocabulary, so generated text is a 400 before sampling) and no
    model name: the sampling fields as generated reach the engine."""
    if not isinstance(body, dict):
        return None
    body = dict(body)
    body.pop("model", None)
    if "prompt" in body:
        body["prompt"] = [3, 4, 5]
    if "messages" in body:
        body["messages"] = [{"role": "user", "content": "in the"}]
        body["chat_template"] = TEMPLATE
        body.pop("chat_template_kwargs", None)
    if "tokens" in body:
        body["tokens"] = [t for t in body["tokens"] if isinstance(t, int) and 0 <= t < 512] or [3]
    return body


def _post(client: TestClient, path: str, body) -> int:
    raw = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True, default=str)
    r = client.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code < 500, (path, raw[:2000], r.status_code, r.text[:2000])
    if r.status_code >= 400:
        assert "error" in r.json(), (path, raw[:500], r.text[:500])
    elif r.status_code == 200:
        kind = r.headers.get("content-type", "")
        if kind.startswith("text/event-stream"):  # "stream": true was generated: events, ending in [DONE]
            assert r.text.rstrip().endswith("data: [DONE]"), (raw[:500], r.text[-500:])
        else:
            assert r.content and r.json(), (raw[:500], kind, r.text[:500])
    return r.status_code


def _engine_alive_and_blocks_free(client: TestClient, allm: AsyncLLM) -> None:
    r = client.post("/v1/completions", json={"prompt": [3, 4, 5], "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    deadline = time.monotonic() + 20
    while (allm.num_in_flight or allm.engine.has_unfinished_requests()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert allm.num_in_flight == 0 and not allm.engine.has_unfinished_requests()
    assert allm.engine.core.stats().num_free_blocks == _total_blocks(client)


def _total_blocks(client: TestClient) -> float:
    text = client.get("/metrics").text
    vals = {}
    for line in text.splitlines():
        if line.startswith(("vllite:kv_cache_free_blocks", "vllite:kv_cache_total_blocks")):
            name, v = line.split(None, 1)
            vals[name.split("{")[0]] = float(v)
    assert vals["vllite:kv_cache_free_blocks"] == vals["vllite:kv_cache_total_blocks"], vals
    return vals["vllite:kv_cache_total_blocks"]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@pytest.mark.parametrize("path", ROUTES)
def test_schemathesis_cases_get_no_5xx(served, path, mode):
    client, allm = served
    schema = schemathesis.openapi.from_dict(client.get("/openapi.json").json())
    strategy = schema[path]["POST"].as_strategy(generation_mode=mode)
    statuses: dict[int, int] = {}

    @hypothesis_seed(1234)
    @settings(max_examples=CASES_PER_ROUTE_AND_MODE, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def run(case):
        body = _bounded(case.body) if case.body is not None else {}
        st_ = _post(client, path, body)
        statuses[st_] = statuses.get(st_, 0) + 1
        fixed = _repaired(body) if mode == GenerationMode.POSITIVE else None
        if fixed is not None:
            st_ = _post(client, path, fixed)
            statuses[st_] = statuses.get(st_, 0) + 1

    run()
    print(path, mode, "status counts:", dict(sorted(statuses.items())))
    assert sum(statuses.values()) >= CASES_PER_ROUTE_AND_MODE // 2, statuses
    _total_blocks(client)


def _raw_cases():
    comp = {"prompt": [3, 4, 5], "max_tokens": 2}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for base, path in ((comp, "/v1/completions"), (chat, "/v1/chat/completions")):
        for field in ("seed", "top_k", "temperature", "max_tokens", "n", "top_p", "priority", "min_tokens",
                      "logprobs" if path == "/v1/completions" else "top_logprobs", "presence_penalty"):
            for lit in BIG:
                yield path, base, field, lit
    for lit in BIG:
        yield "/detokenize", {"tokens": [3]}, "tokens", lit
        yield "/v1/completions", comp, "prompt", lit


def test_raw_big_integers_and_nan_literals_are_400(served):
    """The JSON literals Python's json emits (NaN, Infinity) and integers past int64, in every
    integer / float field: a 400 naming the request, never a 5xx (nothing reaches torch)."""
    client, allm = served
    n = 0
    for path, base, field, lit in _raw_cases():
        body = dict(base)
        body[field] = "@@"
        raw = json.dumps(body)
        value = LITERAL.get(lit, lit)
        if field in ("tokens", "prompt"):
            value = f"[3, {value}]"
        raw = raw.replace('"@@"', value)
        r = client.post(path, content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (path, raw, r.status_code, r.text)
        assert r.json()["error"]["message"], raw
        n += 1
    assert n > 150
    _engine_alive_and_blocks_free(client, allm)


@given(st.integers(min_value=2 ** 63 - 3, max_value=2 ** 66) | st.integers(max_value=-(2 ** 63) - 1,
                                                                        min_value=-(2 ** 66)))
@settings(max_examples=20, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_seed_near_int64_edges(served, value):
    """seed + n - 1 must stay in int64: with n = 4 a seed of 2**63 - 3 is refused, not overflowed."""
    client, _ = served
    status = _post(client, "/v1/completions", {"prompt": [3, 4], "max_tokens": 1, "n": 4, "seed": value})
    assert status == 400


def test_engine_alive_after_fuzzing(served):
    client, allm = served
    _engine_alive_and_blocks_free(client, allm)
