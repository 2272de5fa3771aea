"""Issue 58's last reliability items, against one real server on 127.0.0.1 (two data-parallel engine
cores, a tiny model) with the real openai client:

- admission by estimated cost: logprob entries (prompt_logprobs / echo + logprobs / n x max_tokens x
  logprobs) are charged to --max-logprob-entries-in-flight: a request over it is a 400 naming the field,
  one that does not fit beside the requests in flight a 503 with Retry-After;
"""
from __future__ import annotations

import os
import re
import signal
import threading

import openai
import pytest
from server_harness import ServerProcess
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
