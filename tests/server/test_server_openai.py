"""The OpenAI-compatible server end to end: the real `openai` client against `vllite serve`
(a subprocess on 127.0.0.1, the real SmolLM2 in float32), compared with the offline LLM on the
same weights and settings. One server for the module; it has an API key (from VLLITE_API_KEY)."""
from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import ServerProcess

from vllite_core import LLM, SamplingParams

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "test-key-6d1f"
BODY_LIMIT = 200_000
MAX_SEQS = 32
ENGINE = ["--dtype", "float32", "--max-model-len", "1024", "--num-kv-blocks", "256", "--num-threads", "2"]
SERVER = ENGINE + ["--scheduling-policy", "priority", "--max-num-seqs", str(MAX_SEQS),
                   "--max-request-body-bytes", str(BODY_LIMIT)]
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def launched():
    srv = ServerProcess(SERVER, env={"VLLITE_API_KEY": API_KEY})
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def offline(launched):
    # Loads while the server process loads (launched first).
    return LLM(dtype="float32", max_model_len=1024, num_kv_blocks=256)


@pytest.fixture(scope="module")
def server(launched, offline):
    return launched.wait_ready()


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=180)
    yield c
    c.close()


def post(server: str, path: str, body=None, content: bytes | None = None, headers=AUTH) -> httpx.Response:
    if content is not None:  # raw bytes: still declared JSON (the server refuses other types with 415)
        headers = {**headers, "Content-Type": "application/json"}
    return httpx.post(server + path, json=body, content=content, headers=headers, timeout=180)


def metrics(server: str) -> dict[str, float]:
    text = httpx.get(server + "/metrics", timeout=30).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            label = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{label}}}" if label else "")] = s.value
    return out


def wait_idle(server: str, timeout: float = 120.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        idle = (m["vllite:num_requests_running"] == 0 and m["vllite:num_requests_waiting"] == 0
                and m["vllite:kv_cache_free_blocks"] == m["vllite:kv_cache_total_blocks"])
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def test_startup_line_and_info_routes(launched, server, client):
    assert f"curl {server}/v1/chat/completions" in launched.output
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server + "/health").status_code == 200  # no key needed outside /v1
    assert httpx.get(server + "/version").json()["version"]


def test_completion_matches_offline(client, offline):
    refs = offline.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=20, logprobs=3))
    for prompt, ref in zip(PROMPTS, refs):
        exp = ref.outputs[0]
        resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, logprobs=3)
        ch = resp.choices[0]
        assert ch.text == exp.text and ch.finish_reason == exp.finish_reason
        assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert resp.usage.completion_tokens == len(exp.token_ids)
        assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
        lp = ch.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(exp.token_ids)
        offset = 0
        for i, (tid, entry) in enumerate(zip(exp.token_ids, exp.logprobs)):
            assert lp.tokens[i] == entry[tid].decoded_token
            assert lp.token_logprobs[i] == pytest.approx(entry[tid].logprob, abs=1e-3)
            want = {v.decoded_token: v.logprob for v in entry.values()}
            assert lp.top_logprobs[i].keys() == want.keys() and 3 <= len(want) <= 4
            for tok, val in want.items():
                assert lp.top_logprobs[i][tok] == pytest.approx(val, abs=1e-3)
            assert lp.text_offset[i] == offset
            offset += len(lp.tokens[i])


def test_completion_stream_concatenates_to_full_text(client, offline):
    ref = offline.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=24))[0]
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    pieces, finish, usage = [], None, None
    for chunk in stream:
        for ch in chunk.choices:
            pieces.append(ch.text)
            finish = ch.finish_reason or finish
        usage = chunk.usage or usage
    assert len(pieces) > 3 and "".join(pieces) == ref.outputs[0].text
    assert finish == ref.outputs[0].finish_reason
    assert usage.prompt_tokens == len(ref.prompt_token_ids)
    assert usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_stream_is_sse_ending_in_done(server):
    with httpx.stream("POST", server + "/v1/completions", headers=AUTH, timeout=120,
                      json={"prompt": PROMPTS[2], "max_tokens": 4, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


def test_stop_string_streamed_never_leaks(client, offline):
    # " answer" spans tokens; streamed text must never show a piece of it, and matches offline.
    params = dict(temperature=0.0, max_tokens=40, stop=["The answer", "\n\n\n"])
    ref = offline.generate(PROMPTS[0], SamplingParams(**params))[0].outputs[0]
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[0], **params)
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], stream=True, **params)
    streamed = "".join(ch.text for chunk in stream for ch in chunk.choices)
    assert whole.choices[0].text == streamed == ref.text
    assert whole.choices[0].finish_reason == ref.finish_reason


def test_chat_matches_offline(client, offline):
    ref = offline.chat(CHAT, SamplingParams(temperature=0.0, max_tokens=24, logprobs=2))[0]
    exp = ref.outputs[0]
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_completion_tokens=24,
                                          logprobs=True, top_logprobs=2)
    ch = resp.choices[0]
    assert ch.message.role == "assistant" and ch.message.content == exp.text
    assert ch.finish_reason == exp.finish_reason
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == len(exp.token_ids)
    content = ch.logprobs.content
    assert len(content) == len(exp.token_ids)
    for item, tid, entry in zip(content, exp.token_ids, exp.logprobs):
        assert item.token == entry[tid].decoded_token
        assert item.logprob == pytest.approx(entry[tid].logprob, abs=1e-3)
        top = sorted((v for v in entry.values() if v.rank <= 2), key=lambda v: v.rank)
        assert [t.token for t in item.top_logprobs] == [v.decoded_token for v in top]
        assert [t.logprob for t in item.top_logprobs] == pytest.approx([v.logprob for v in top], abs=1e-3)
        assert bytes(item.bytes) == item.token.encode()

    stream = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=24, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == exp.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(exp.token_ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == exp.finish_reason


def test_n_with_seed_is_reproducible(client, offline):
    kw = dict(model=MODEL, prompt="Once upon a time", n=2, seed=1234, temperature=1.0, max_tokens=12)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1]
    texts = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(b.choices, key=lambda c: c.index)]
    ref = offline.generate("Once upon a time", SamplingParams(n=2, seed=1234, temperature=1.0, max_tokens=12))[0]
    assert texts == [o.text for o in ref.outputs]
    assert a.usage.completion_tokens == sum(len(o.token_ids) for o in ref.outputs)


def test_priority_and_vllm_extensions_accepted(client):
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0,
                                     extra_body={"priority": -3, "top_k": 5, "ignore_eos": True, "min_tokens": 5,
                                                 "cache_salt": "tenant-1"})
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 5


def test_prompt_logprobs(client, offline):
    ref = offline.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2))[0]
    if ref.prompt_logprobs is None:
        pytest.xfail("the engine does not return prompt logprobs yet")
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2, temperature=0,
                                     extra_body={"prompt_logprobs": 2})
    got = resp.choices[0].model_extra["prompt_logprobs"]
    assert len(got) == len(ref.prompt_token_ids) == len(ref.prompt_logprobs) and got[0] is None
    for pos, want in zip(got[1:], ref.prompt_logprobs[1:]):
        assert {int(k) for k in pos} == set(want)
        for tid, lp in want.items():
            assert pos[str(tid)]["logprob"] == pytest.approx(lp.logprob, abs=1e-3)


BAD = [  # (path, json body or raw bytes, status, param)
    ("/v1/completions", b'{"prompt": "hi", ', 400, None),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "max_token": 5}, 400, "max_token"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"prompt": "hi", "logits_processors": ["mod:fn"]}, 400, "logits_processors"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": [17] * 1100}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", b'{"prompt": "' + b"a" * (BODY_LIMIT + 10) + b'"}', 413, None),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "stream": True, "priority": "high"}, 400, "priority"),
    ("/v1/completions", {"prompt": "hi", "cache_salt": ""}, 400, "cache_salt"),
    ("/v1/chat/completions", {"messages": CHAT, "stream": True, "cache_salt": 5}, 400, "cache_salt"),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[
    "malformed-json", "wrong-type", "unknown-field", "negative-max-tokens", "negative-temperature", "n-zero",
    "best-of", "per-request-logits-processor", "too-many-logprobs", "prompt-too-long", "empty-prompt",
    "unknown-model", "huge-body", "empty-messages", "content-wrong-type", "bad-role", "tools", "top-logprobs-alone",
    "priority-wrong-type", "cache-salt-empty", "cache-salt-wrong-type"])
def test_bad_input_is_refused_in_openai_shape(server, path, body, status, param):
    r = post(server, path, content=body) if isinstance(body, bytes) else post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    if param == "prompt" and status == 400 and body != {"prompt": []}:
        assert err["code"] == "context_length_exceeded"
    if status == 404:
        assert err["code"] == "model_not_found"
    ok = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})  # the server still serves
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", temperature=-1.0)
    assert e.value.status_code == 400 and e.value.param == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT)


def test_api_key_required_on_v1(server):
    body = {"prompt": "Hi", "max_tokens": 1}
    missing = post(server, "/v1/completions", body, headers={})
    wrong = post(server, "/v1/completions", body, headers={"Authorization": "Bearer nope"})
    for r in (missing, wrong, httpx.get(server + "/v1/models")):
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert post(server, "/v1/completions", body).status_code == 200
    bad = openai.OpenAI(base_url=server + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    bad.close()


def test_tokenize_detokenize_roundtrip(server, offline):
    text = "Hello, world! Héllo wörld."
    tok = post(server, "/tokenize", {"prompt": text}).json()
    assert tok["tokens"] == offline.get_tokenizer().encode(text) and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == 1024
    assert post(server, "/detokenize", {"tokens": tok["tokens"]}).json()["prompt"] == text
    chat = post(server, "/tokenize", {"messages": CHAT}).json()
    assert chat["tokens"] == offline.get_tokenizer().encode(offline.apply_chat_template(CHAT))
    assert post(server, "/detokenize", {"tokens": [10 ** 9]}).status_code == 400


def test_metrics_parse_and_move(server, client):
    names = {fam.name for fam in text_string_to_metric_families(httpx.get(server + "/metrics").text)}
    for name in ("vllite:request_success", "vllite:time_to_first_token_seconds", "vllite:time_per_output_token_seconds",
                 "vllite:e2e_request_latency_seconds", "vllite:num_requests_running", "vllite:num_requests_waiting",
                 "vllite:kv_cache_usage_perc", "vllite:prefix_cache_hit_rate", "vllite:num_preemptions",
                 "vllite:prompt_tokens", "vllite:generation_tokens", "vllite:engine_loop_seconds"):
        assert name in names
    before = metrics(server)
    client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=7, temperature=0,
                              extra_body={"ignore_eos": True})
    after = metrics(server)
    length = "vllite:request_success_total{finished_reason=length}"
    assert after[length] == before[length] + 1
    assert after["vllite:generation_tokens_total"] == before["vllite:generation_tokens_total"] + 7
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "time_per_output_token_seconds"):
        assert after[f"vllite:{h}_count"] == before[f"vllite:{h}_count"] + 1
    # The same prompt again: its full blocks come from the prefix cache.
    assert after["vllite:prefix_cache_queries_total"] > before["vllite:prefix_cache_queries_total"]


# What a dashboard made for vLLM reads (vLLM's names and label names; counters end in _total).
VLLM_METRICS = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge", "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter", "vllm:request_success": "counter",
    "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter", "vllm:num_preemptions": "counter",
    "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram", "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram", "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram", "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram", "vllm:request_generation_tokens": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram", "vllm:request_params_n": "histogram",
    "vllm:request_params_max_tokens": "histogram", "vllm:cache_config_info": "gauge",
}


def test_vllm_named_metrics(server, client):
    def families() -> dict:
        return {f.name: f for f in text_string_to_metric_families(httpx.get(server + "/metrics").text)}

    fams = families()
    for name, kind in VLLM_METRICS.items():
        assert name in fams and fams[name].type == kind, name
        for s in fams[name].samples:
            assert s.labels["engine"] == "0" and (name == "vllm:cache_config_info" or s.labels["model_name"] == MODEL)
    # Every series the example Grafana dashboard reads exists.
    dashboard = json.loads((ROOT / "examples/observability/grafana_dashboard.json").read_text())
    series = {s.name for f in fams.values() for s in f.samples}
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    for name in set(re.findall(r"vllm:[a-z0-9_]+", " ".join(exprs))):
        assert name in series, name
    info = fams["vllm:cache_config_info"].samples[0].labels
    assert info["block_size"] == "16" and info["num_gpu_blocks"] == "256"

    def value(fams: dict, name: str, sample: str, **labels) -> float:
        return sum(s.value for s in fams[name].samples
                   if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))

    text = "The history of the old harbour town begins with fishermen. " * 4  # over two KV blocks
    prompt = client.completions.create(model=MODEL, prompt=text, max_tokens=1).usage.prompt_tokens
    before = families()
    client.completions.create(model=MODEL, prompt=text, max_tokens=9, temperature=0, n=2,
                              extra_body={"ignore_eos": True})
    after = families()

    def moved(name: str, sample: str, **labels) -> float:
        return value(after, name, sample, **labels) - value(before, name, sample, **labels)

    assert moved("vllm:generation_tokens", "vllm:generation_tokens_total") == 18
    assert moved("vllm:prompt_tokens", "vllm:prompt_tokens_total") == prompt
    assert moved("vllm:request_success", "vllm:request_success_total", finished_reason="length") == 2
    # Two completions of 9 tokens, decoded side by side: 8 gaps between the steps that brought tokens.
    assert moved("vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count") == 8
    assert moved("vllm:request_params_n", "vllm:request_params_n_sum") == 2
    assert moved("vllm:request_params_max_tokens", "vllm:request_params_max_tokens_sum") == 9
    assert moved("vllm:request_max_num_generation_tokens", "vllm:request_max_num_generation_tokens_sum") == 9
    assert moved("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") > 0  # the same prompt, just before
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_prefill_time_seconds",
              "request_decode_time_seconds", "request_inference_time_seconds", "request_queue_time_seconds"):
        assert moved(f"vllm:{h}", f"vllm:{h}_count") == 1, h
    # The phases add up: queue + inference = e2e as the engine saw it (the API's arrival is earlier).
    e2e = moved("vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_sum")
    inference = moved("vllm:request_inference_time_seconds", "vllm:request_inference_time_seconds_sum")
    prefill = moved("vllm:request_prefill_time_seconds", "vllm:request_prefill_time_seconds_sum")
    decode = moved("vllm:request_decode_time_seconds", "vllm:request_decode_time_seconds_sum")
    assert 0 < prefill <= inference <= e2e
    assert abs(prefill + decode - inference) < 1e-6 * max(1.0, inference) + 1e-9


def test_concurrent_streams_with_disconnects(server, offline):
    """64 streams of mixed lengths at once; 8 of them hang up after two chunks. The rest match
    offline greedy text, the 8 are aborted, and every KV block comes back."""
    # 8 distinct (prompt, length) pairs, each sent 8 times: the reference is 8 offline requests.
    prompts = [f"Story number {i % 8}: once upon a time, in a land far away," for i in range(64)]
    lengths = [2 + 2 * (i % 8) for i in range(64)]  # 2..16 tokens
    quitters = set(range(3, 64, 8))
    keep = [i for i in range(64) if i not in quitters]
    refs8 = offline.generate(prompts[:8], [SamplingParams(temperature=0.0, max_tokens=lengths[i], ignore_eos=True)
                                           for i in range(8)])
    refs = [refs8[i % 8] for i in keep]
    before = wait_idle(server)

    async def main() -> dict[int, str | None]:
        ac = openai.AsyncOpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=300)

        async def one(i: int) -> str | None:
            quit_early = i in quitters
            stream = await ac.completions.create(model=MODEL, prompt=prompts[i], temperature=0, stream=True,
                                                 max_tokens=500 if quit_early else lengths[i],
                                                 extra_body={"ignore_eos": True})
            text, n = "", 0
            async for chunk in stream:
                text += "".join(c.text for c in chunk.choices)
                n += 1
                if quit_early and n == 2:
                    await stream.close()
                    return None
            return text

        try:
            got = await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await ac.close()
        return dict(enumerate(got))

    got = asyncio.run(main())
    for i, ref in zip(keep, refs):
        assert got[i] == ref.outputs[0].text, f"request {i}"
    after = wait_idle(server)
    assert after["vllite:kv_cache_free_blocks"] == before["vllite:kv_cache_free_blocks"]
    assert after["vllite:num_requests_running"] == 0 and after["vllite:num_requests_in_flight"] == 0
    abort = "vllite:request_success_total{finished_reason=abort}"
    assert after[abort] == before[abort] + len(quitters)


def test_priority_request_overtakes_under_saturation(server):
    """64 requests of priority 0 fill the 32 slots twice over; one of priority -1 sent after them
    must not wait for all of them: under fcfs it would run alone, last."""
    n_low = 2 * MAX_SEQS

    async def main() -> list[str]:
        order: list[str] = []
        ac = openai.AsyncOpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=300)

        async def one(tag: str, priority: int) -> None:
            await ac.completions.create(model=MODEL, prompt=f"Request {tag}:", max_tokens=6, temperature=0,
                                        extra_body={"ignore_eos": True, "priority": priority})
            order.append(tag)

        try:
            low = [asyncio.create_task(one(str(i), 0)) for i in range(n_low)]
            async with httpx.AsyncClient() as hc:
                for _ in range(600):  # until they are all queued or running
                    text = (await hc.get(server + "/metrics")).text
                    fams = {f.name: f.samples[0].value for f in text_string_to_metric_families(text) if f.samples}
                    if fams["vllite:num_requests_waiting"] >= MAX_SEQS:
                        break
                    await asyncio.sleep(0.05)
            await asyncio.gather(one("urgent", -1), *low)
        finally:
            await ac.close()
        return order

    order = asyncio.run(main())
    assert len(order) == n_low + 1
    assert order.index("urgent") < 2 * MAX_SEQS, order


def test_non_streaming_client_that_gives_up_is_aborted(server):
    before = wait_idle(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/v1/completions", headers=AUTH, timeout=httpx.Timeout(60, read=1.5),
                   json={"prompt": PROMPTS[1], "max_tokens": 900, "ignore_eos": True})
    after = wait_idle(server)
    abort = "vllite:request_success_total{finished_reason=abort}"
    assert after[abort] == before[abort] + 1
    assert after["vllite:kv_cache_free_blocks"] == before["vllite:kv_cache_free_blocks"]


def test_cache_salt_isolates_tenants(server, client):
    """The real openai client, vLLM's `cache_salt` in the body: the same prompt under another salt hits nothing
    in the prefix cache (the server's counters), under the same salt it hits."""
    prompt = "Tenant data: " + " ".join(f"item{i}" for i in range(40))

    def hits(salt: str | None) -> float:
        before = wait_idle(server)["vllite:prefix_cache_hits_total"]
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                  extra_body={"cache_salt": salt} if salt else None)
        return wait_idle(server)["vllite:prefix_cache_hits_total"] - before

    assert hits("tenant-a") == 0
    assert hits("tenant-a") >= 32  # at least two full blocks of 16 tokens
    assert hits("tenant-b") == 0
    assert hits(None) == 0
    assert hits("tenant-b") >= 32
