"""`vllite serve --uds PATH`: the server listens on a unix domain socket (no TCP port), the real
``openai`` client reaches it through an httpx UDS transport, and the socket file is removed at exit.
Reference: the offline engine's greedy tokens on the same tiny random weights."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "tiny-uds"
ENGINE = dict(dtype="float32", max_model_len=256, num_kv_blocks=64)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from tiny_models import TINY, save_tiny
    from transformers import LlamaConfig

    from model_registry.source import load_tokenizer, resolve_model_source

    path = tmp_path_factory.mktemp("tiny-uds")
    tok = load_tokenizer(resolve_model_source(None))
    save_tiny(path, LlamaConfig(**{**TINY, "vocab_size": len(tok)}, architectures=["LlamaForCausalLM"]), tokenizer=tok)
    return str(path)


@pytest.fixture(scope="module")
def served(model_path, tmp_path_factory):
    uds = str(tmp_path_factory.mktemp("sock") / "vllite.sock")
    env = dict(os.environ, VLLITE_LOG_LEVEL="WARNING", HF_HUB_OFFLINE="1")
    proc = subprocess.Popen([sys.executable, "-m", "vllite_core.entrypoints.cli", "serve", "--uds", uds,
                             "--model", model_path, "--served-model-name", MODEL, "--num-threads", "1",
                             "--uvicorn-log-level", "warning", "--disable-access-log",
                             *(f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items())],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    transport = httpx.HTTPTransport(uds=uds)
    client = httpx.Client(transport=transport, base_url="http://localhost", timeout=120)
    deadline = time.monotonic() + 300
    try:
        while True:
            assert proc.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "".join(lines)
            try:
                if client.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield uds, client, lines, proc
    finally:
        client.close()
        proc.terminate()
        proc.wait(60)


def test_openai_client_over_a_unix_socket_matches_the_offline_engine(served, model_path):
    from vllite_core import LLM, SamplingParams

    uds, http, lines, proc = served
    assert f"on unix socket {uds}" in "".join(lines)
    client = openai.OpenAI(base_url="http://localhost/v1", api_key="none", max_retries=0,
                           http_client=httpx.Client(transport=httpx.HTTPTransport(uds=uds), timeout=120))
    got = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=8, temperature=0.0)
    ref = LLM(model=model_path, **ENGINE).generate([{"prompt_token_ids": [5, 6, 7, 8]}],
                                                  SamplingParams(temperature=0.0, max_tokens=8))
    assert got.choices[0].text == ref[0].outputs[0].text and got.usage.completion_tokens == 8
    assert http.get("/v1/models").json()["data"][0]["id"] == MODEL


def test_socket_file_is_removed_when_the_server_stops(served):
    uds, _, _, proc = served
    assert os.path.exists(uds)
    proc.terminate()
    assert proc.wait(60) == 0
    assert not os.path.exists(uds)
