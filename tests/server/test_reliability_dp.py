"""Issue 58's last reliability items, against one real server on 127.0.0.1 (two data-parallel engine
cores, a tiny model) with the real openai client:

- admission by estimated cost: logprob entries (prompt_logprobs / echo + logprobs / n x max_tokens x
  logprobs) are charged to --max-logprob-entries-in-flight: a request over it is a 400 naming the field,
  one that does not fit beside the requests in flight a 503 with Retry-After;
- one data-parallel core killed mid-stream fails only the requests on it: the other core's streams
  finish with the same greedy text as before the kill, and the dead core comes back;
- its restart never holds the live core: with the restarting core's new process stopped before it can
  be ready, the live core's streams finish and requests that arrive meanwhile are served by it, all
  while /health still says the core restarts (the order of events, not their timing, is asserted).
  (Requests that wait for a restart when no core is live: tests/engine/test_core_restart.py.)
"""
from __future__ import annotations

import json
import os
import re
import signal
import threading

import httpx
import openai
import pytest
from server_harness import ServerProcess
from test_core_restart import core_pids
from tiny_models import TINY, save_tiny

pytestmark = pytest.mark.slow

BUDGET = 3000  # --max-logprob-entries-in-flight


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tiny-llama-dp")
    save_tiny(path, LlamaConfig(**{**TINY, "max_position_embeddings": 4096}, architectures=["LlamaForCausalLM"]))
    return str(path)


@pytest.fixture(scope="module")
def server(model_path):
    srv = ServerProcess(["--model", model_path, "--served-model-name", "tiny", "--data-parallel-size", "2",
                         "--max-logprob-entries-in-flight", str(BUDGET), "--engine-restart-max", "3",
                         "--max-num-seqs", "8"])
    try:
        srv.wait_ready(600)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def core_pid(server: ServerProcess, rank: int) -> int:
    """An engine core's pid, from the start-up layout line (or the latest restart's log)."""
    found = re.findall(rf"DP rank {rank} pid (\d+)", server.output)
    assert found, server.output
    return int(found[-1])


def test_costly_requests_are_refused_naming_the_field(client):
    long_prompt = list(range(5, 255))  # 250 tokens: 249 prompt rows
    cases = [  # (kwargs, the field named)
        (dict(prompt=long_prompt, max_tokens=1, extra_body={"prompt_logprobs": 20}), "prompt_logprobs"),
        (dict(prompt=long_prompt, max_tokens=1, echo=True, logprobs=15), "echo"),
        (dict(prompt=[5, 6, 7], max_tokens=200, n=4, logprobs=5), "logprobs"),
    ]
    for kw, field in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", **kw)
        err = e.value.body
        assert err["param"] == field and err["code"] == "request_too_costly", err
        assert "--max-logprob-entries-in-flight" in err["message"] and str(BUDGET) in err["message"]
    # the same request, cheaper, fits: its prompt logprobs come back, one row per prompt token
    out = client.completions.create(model="tiny", prompt=long_prompt[:100], max_tokens=1,
                                    extra_body={"prompt_logprobs": 20})
    assert len(out.choices[0].model_extra["prompt_logprobs"]) == 100


def test_costly_requests_wait_their_turn(server, client):
    """One request holding 2,000 of the 3,000 entries: a second such one gets 503 + Retry-After while it
    runs (the engine cores are stopped so that it cannot finish meanwhile), a cheap one is accepted, and
    the second one is accepted once the first has ended."""
    costly = dict(model="tiny", prompt=[5, 6, 7], max_tokens=1000, logprobs=1, temperature=0,
                  extra_body={"ignore_eos": True})  # 1000 x 2 entries
    pids = [core_pid(server, r) for r in (0, 1)]
    first = client.completions.create(stream=True, **costly)
    next(iter(first))  # admitted and running
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        raw = client.completions.with_raw_response
        with pytest.raises(openai.APIStatusError) as e:
            raw.create(**costly)
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
        assert e.value.body["code"] == "server_overloaded" and "logprob entries" in e.value.body["message"]
        cheap: list = []
        t = threading.Thread(target=lambda: cheap.append(
            client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3, logprobs=1)))
        t.start()
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    t.join(120)
    assert cheap and cheap[0].choices[0].finish_reason == "length"
    first.close()  # the server aborts it: its entries are released
    for _ in range(100):
        try:
            out = client.completions.create(**{**costly, "max_tokens": 10})
            break
        except openai.APIStatusError as e:
            assert e.status_code == 503
            threading.Event().wait(0.1)
    assert out.choices[0].finish_reason == "length" and len(out.choices[0].logprobs.tokens) == 10


def test_large_bodies_are_validated_off_the_loop_with_the_same_answers(server, client):
    """A 1.6 MiB body (over body_parser's 1 MiB) goes through the helper process: a bad field is the
    usual 400 naming it; a valid one reaches the engine (its prompt is over the context: 400 too)."""
    ids = list(range(100, 100 + 250_000))
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=ids, max_tokens=1, extra_body={"top_k": "many"})
    assert e.value.body["param"] == "top_k", e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=ids, max_tokens=1)
    assert e.value.body["code"] == "context_length_exceeded" and "250000" in e.value.body["message"]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200

PROMPTS = [[11 + i, 12, 13 + 2 * i] for i in range(6)]
MAX_TOKENS = 1000  # long enough that every stream is still open when the core is killed


class Stream(threading.Thread):
    """A streamed greedy completion: its text, whether a token came, its finish reason or error event."""

    def __init__(self, url: str, prompt: list[int]) -> None:
        super().__init__(daemon=True)
        self.url, self.prompt = url, prompt
        self.text, self.finish, self.error = "", None, None
        self.got_token = threading.Event()

    def run(self) -> None:
        body = {"model": "tiny", "prompt": self.prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    self.error = event["error"]
                    continue
                for c in event["choices"]:
                    self.text += c["text"]
                    self.finish = c["finish_reason"] or self.finish
                    self.got_token.set()
        self.got_token.set()


def spawned_children(server: ServerProcess) -> set[int]:
    """The server's multiprocessing-spawned children (its engine cores)."""
    return set(core_pids(server.proc.pid))


def greedy(client, prompt: list[int], max_tokens: int = MAX_TOKENS) -> str:
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                    extra_body={"ignore_eos": True})
    return out.choices[0].text


def test_a_dead_dp_core_fails_only_its_requests_and_its_restart_never_holds_the_live_core(server, client):
    refs = [None] * len(PROMPTS)

    def ref(i: int) -> None:
        refs[i] = greedy(client, PROMPTS[i])
    threads = [threading.Thread(target=ref, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    late_ref = greedy(client, [7, 8, 9], 8)
    pid0, pid1 = core_pid(server, 0), core_pid(server, 1)
    children = spawned_children(server)
    streams = [Stream(server.url, p) for p in PROMPTS]
    for s in streams:  # the client sends each to the core with fewer requests: 3 and 3
        s.start()
    for s in streams:
        assert s.got_token.wait(120)
    for pid in (pid0, pid1):  # hold every stream where it is, then kill core 1
        os.kill(pid, signal.SIGSTOP)
    assert not any(s.finish for s in streams), "a stream finished before the kill"
    os.kill(pid1, signal.SIGKILL)
    os.kill(pid0, signal.SIGCONT)
    new_core = None
    for _ in range(1200):  # core 1's new process: stopped at once, so it cannot be ready before we let it
        fresh = spawned_children(server) - children
        if fresh:
            (new_core,) = fresh
            os.kill(new_core, signal.SIGSTOP)
            break
        threading.Event().wait(0.05)
    assert new_core is not None, server.output[-3000:]
    try:
        r = httpx.get(server.url + "/health", timeout=10)  # the core restarts: 503 engine_restarting
        assert r.status_code == 503 and "restarting" in r.text, r.text
        late: list = [None] * 3

        def send(i: int) -> None:
            try:
                late[i] = greedy(client, [7, 8, 9], 8)
            except openai.APIStatusError as e:
                late[i] = e
        senders = [threading.Thread(target=send, args=(i,)) for i in range(3)]
        for t in senders:
            t.start()
        for t in senders + streams:
            t.join(300)
        failed = [s for s in streams if s.error is not None]
        finished = [s for s in streams if s.error is None]
        assert failed and finished, [(s.finish, s.error) for s in streams]
        for s in failed:
            assert s.error["code"] == "engine_dead" and "SIGKILL" in s.error["message"], s.error
        for s in finished:  # the live core's requests: whole and correct, while core 1 could not be ready
            assert s.finish == "length" and s.text == refs[streams.index(s)]
        assert late == [late_ref] * 3  # newcomers went to the live core
        r = httpx.get(server.url + "/health", timeout=10)  # ... and all this before core 1 came back
        assert r.status_code == 503 and "restarting" in r.text, r.text
    finally:
        os.kill(new_core, signal.SIGCONT)
    for _ in range(6000):
        if httpx.get(server.url + "/health", timeout=10).status_code == 200:
            break
        threading.Event().wait(0.1)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    os.kill(pid0, 0)  # the live core was never restarted
    assert core_pid(server, 0) == pid0
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert re.search(r"^vllite:engine_core_restarts_total(\{[^}]*\})? 1(\.0)?$", metrics, re.M), metrics[-2000:]
    # both cores serve again: one stream held on core 0 (stopped), the next request goes to core 1 and is served
    first = Stream(server.url, PROMPTS[0])
    first.start()
    assert first.got_token.wait(120)
    os.kill(pid0, signal.SIGSTOP)
    try:
        assert greedy(client, PROMPTS[1]) == refs[1]
    finally:
        os.kill(pid0, signal.SIGCONT)
    first.join(300)
    assert first.finish == "length" and first.text == refs[0]
