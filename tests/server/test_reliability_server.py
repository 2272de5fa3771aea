"""Issue 58's attack table against a real `vllite serve` on 127.0.0.1 (the tiny random Llama), one
server for the module. While each attack runs, a canary (/health and a 1-token completion every
0.2 s, tests/canary.py) must see no failure and a worst latency under 1 s plus 3x the worst of a
quiet baseline measured just before (the shared 2-core box is slow on its own at times).

Rows: 1-2 a hanging / bloating request chat_template (400 naming chat_template); 3 a guided_json
schema nested 900 deep and 5 a 50k-entry enum (400 naming the field, checked off the event loop);
6 the engine core stopped (SIGSTOP): /health 503, then 200 once it runs again; 9 /detokenize of a
body's worth of ids (decoding holds the GIL: capped at the context) and max_tokens past the context:
400 in vLLM's words; 10 a second Ctrl-C ends the streams with an error event and exits non-zero."""
from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx
import pytest
from canary import Canary, CanaryReport, measure, responsive
from server_harness import ServerProcess

pytestmark = pytest.mark.slow

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # ids within the tiny vocabulary
CHAT = [{"role": "user", "content": "in the"}]
HANG = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
BLOAT = "{{ 'x' * 1500000000 }}"
HUGE_OUTPUT = "{% for i in range(100000) %}{{ 'y' * 99999 }}{% endfor %}"
MAX_MODEL_LEN = 8192


@pytest.fixture(scope="module")
def long_tiny_path(tmp_path_factory):
    """The tiny random Llama with a long context, so that streams outlast a second Ctrl-C."""
    from tiny_models import TINY, save_tiny
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tiny-llama-long")
    save_tiny(path, LlamaConfig(**{**TINY, "max_position_embeddings": MAX_MODEL_LEN},
                                architectures=["LlamaForCausalLM"]))
    return str(path)


@pytest.fixture(scope="module")
def server(long_tiny_path):
    srv = ServerProcess([long_tiny_path, "--dtype", "float32", "--num-kv-blocks", "2048", "--max-model-len",
                         str(MAX_MODEL_LEN), "--chat-template", TEMPLATE, "--trust-request-chat-template",
                         "--chat-template-timeout", "1", "--chat-template-max-output-chars", "100000",
                         "--shutdown-timeout", "120"])
    try:
        srv.wait_ready(300)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def baseline(server) -> CanaryReport:
    return measure(server.url, 3.0)


def _chat(url: str, **extra: object) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, **extra}, timeout=120)


def _check_canary(canary: Canary, baseline: CanaryReport, what: str) -> None:
    r = canary.report
    print(f"{what}: canary worst {r.worst_s:.3f} s, p99 {r.p99_s():.3f} s over "
          f"{len(r.health_s) + len(r.completion_s)} probes (quiet baseline worst {baseline.worst_s:.3f} s)")
    assert r.health_s and r.completion_s
    assert responsive(r, baseline), (r.failures[:3], r.worst_s, baseline.worst_s)


def test_rows_1_2_hanging_and_bloating_templates(server, baseline):
    url = server.url
    assert _chat(url, chat_template=TEMPLATE).status_code == 200  # trusted: a request's own template renders
    with Canary(url) as canary:
        for bad in (HANG, BLOAT, HUGE_OUTPUT, HANG):
            r = _chat(url, chat_template=bad)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "chat_template" and err["code"] == "chat_template_over_budget", err
    r = httpx.post(url + "/tokenize", json={"messages": CHAT}, timeout=60)  # the same sandbox
    assert r.status_code == 200 and r.json()["count"] > 0
    assert _chat(url).status_code == 200  # the pool renders again after the kills
    _check_canary(canary, baseline, "templates")


def test_rows_3_5_deep_schema_and_huge_enum_are_400_naming_the_field(server, baseline):
    url = server.url
    deep = '{"type": "object", "default": ' + "[" * 900 + "]" * 900 + "}"
    enum = {"type": "object", "properties": {"k": {"enum": [f"e{i}" for i in range(50000)]}}}
    small_enum = {"type": "object", "properties": {"k": {"enum": [f"e{i}" for i in range(5000)]}}}
    with Canary(url) as canary:
        for body, field in ((dict(guided_json=deep), "guided_json"), (dict(guided_json=enum), "guided_json"),
                            (dict(guided_json=small_enum), "guided_json"),
                            (dict(structured_outputs={"json": deep}), "structured_outputs.json")):
            r = httpx.post(url + "/v1/completions", json={"prompt": [3, 4], "max_tokens": 2, **body}, timeout=120)
            assert r.status_code == 400, r.text[:500]
            assert r.json()["error"]["param"] == field, r.text[:500]
    ok = httpx.post(url + "/v1/completions", json={"prompt": [3, 4], "max_tokens": 2,
                                                   "structured_outputs": {"choice": ["a", "b"]}}, timeout=120)
    assert ok.status_code == 200, ok.text  # structured requests are served
    _check_canary(canary, baseline, "structured specs")


def _core_pid(server: ServerProcess) -> int:
    m = re.search(r"DP rank 0 pid (\d+)", server.output)
    assert m, server.output
    return int(m.group(1))


def test_row_6_a_stopped_engine_core_is_503_then_recovers(server):
    url, pid = server.url, _core_pid(server)
    assert pid != server.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        r = httpx.get(url + "/health", timeout=30)
        assert r.status_code == 503 and "stopped" in r.json()["error"]["message"], r.text
    finally:
        os.kill(pid, signal.SIGCONT)
    end = time.monotonic() + 60
    while httpx.get(url + "/health", timeout=30).status_code != 200:
        assert time.monotonic() < end
        time.sleep(0.2)
    r = httpx.post(url + "/v1/completions", json={"prompt": [3, 4], "max_tokens": 2}, timeout=120)
    assert r.status_code == 200, r.text


def test_row_9_detokenize_capped_and_max_tokens_past_the_context(server, baseline):
    url = server.url
    ids = [3, 4, 5, 6] * 50_000  # 200k ids: 0.3 s of GIL-holding decode had it been served
    with Canary(url) as canary:
        for _ in range(3):
            r = httpx.post(url + "/detokenize", content=json.dumps({"tokens": ids}),
                           headers={"Content-Type": "application/json"}, timeout=120)
            assert r.status_code == 400 and r.json()["error"]["param"] == "tokens", r.text[:300]
            r = httpx.post(url + "/detokenize", json={"tokens": ids[:MAX_MODEL_LEN]}, timeout=120)
            assert r.status_code == 200 and len(r.json()["prompt"]) > 0
    _check_canary(canary, baseline, "detokenize")
    r = httpx.post(url + "/detokenize", json={"tokens": [3, 10 ** 6]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = httpx.post(url + "/v1/completions", json={"prompt": [3, 4], "max_tokens": 10 ** 9}, timeout=60)
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert msg == (f"'max_tokens' or 'max_completion_tokens' is too large: {10 ** 9}. This model's maximum context "
                   f"length is {MAX_MODEL_LEN} tokens and your request has 2 input tokens "
                   f"({10 ** 9} > {MAX_MODEL_LEN} - 2).")
    r = _chat(url, max_completion_tokens=MAX_MODEL_LEN)
    assert r.status_code == 400 and "is too large" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", json={"prompt": [3, 4], "max_tokens": MAX_MODEL_LEN - 1}, timeout=60)
    assert r.status_code == 400 and f"({MAX_MODEL_LEN - 1} > {MAX_MODEL_LEN} - 2)" in r.text  # one past what is left


def _stream(url: str, out: list, started: threading.Event) -> None:
    events: list[str] = []
    body = {"prompt": [3, 4], "max_tokens": MAX_MODEL_LEN - 2, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    started.set()
        out.append(("ok", events))
    except httpx.HTTPError as e:
        out.append(("cut", f"{type(e).__name__}: {e}", events))
    started.set()


def test_row_10_a_second_ctrl_c_ends_streams_with_an_error_event_and_exits_non_zero(server):
    """Last in the module: it stops the server. The drain (--shutdown-timeout 120) would outlast the
    test; the second Ctrl-C ends the streams at once, each with an error event and [DONE]."""
    results: list = []
    threads = []
    for _ in range(3):
        started = threading.Event()
        t = threading.Thread(target=_stream, args=(server.url, results, started))
        t.start()
        assert started.wait(60)
        threads.append(t)
    server.proc.send_signal(signal.SIGINT)
    end = time.monotonic() + 60
    while "waiting up to" not in server.output:  # the first signal's drain began
        assert time.monotonic() < end, server.output
        time.sleep(0.1)
    server.proc.send_signal(signal.SIGINT)
    for t in threads:
        t.join(60)
    assert server.proc.wait(60) != 0, server.output
    assert len(results) == 3 and all(r[0] == "ok" for r in results), results
    for _, events in results:
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["error"]["code"] == "server_shutting_down"
    assert "second signal" in server.output and "Traceback" not in server.output, server.output
