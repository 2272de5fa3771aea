"""`vllite run-batch` (a subprocess, as users run it): OpenAI batch JSONL in and out. References: the
offline LLM on the same weights (greedy text of each completions / chat line), sentence-transformers
for embeddings; failed lines are reported in place (keyed by custom_id) and the others still run."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from tiny_pooling import minilm_path

pytestmark = pytest.mark.slow

ENGINE = ["--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "64", "--num-threads", "1"]
CHAT = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from tiny_models import TINY, save_tiny
    from transformers import LlamaConfig

    from model_registry.source import load_tokenizer, resolve_model_source

    path = tmp_path_factory.mktemp("tiny-batch")
    tok = load_tokenizer(resolve_model_source(None))
    save_tiny(path, LlamaConfig(**{**TINY, "vocab_size": len(tok)}, architectures=["LlamaForCausalLM"]), tokenizer=tok)
    return str(path)


def run_batch(tmp_path, lines: list[str], *args: str) -> tuple[list[dict], str]:
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    env = dict(os.environ, VLLITE_LOG_LEVEL="WARNING", HF_HUB_OFFLINE="1")
    p = subprocess.run([sys.executable, "-m", "vllite_core.entrypoints.cli", "run-batch", "-i", str(src), "-o",
                        str(dst), *args], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    return [json.loads(t) for t in dst.read_text().splitlines()], p.stdout + p.stderr


def line(cid, url, body):
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def test_generation_lines_and_failures_in_place(tmp_path, model_path):
    from vllite_core import LLM, SamplingParams

    lines = [
        line("chat-1", "/v1/chat/completions", {"model": "m", "messages": CHAT, "max_tokens": 6, "temperature": 0}),
        line("cmpl-1", "/v1/completions", {"model": "m", "prompt": "The sky is", "max_tokens": 6, "temperature": 0}),
        "{not json",
        line("bad-field", "/v1/chat/completions", {"model": "m", "messages": CHAT, "max_tokenz": 6}),
        line("embed-gen", "/v1/embeddings", {"model": "m", "input": "hello"}),  # a generative model: refused
        line("bad-url", "/v1/files", {}),
        line("chat-2", "/v1/chat/completions", {"model": "m", "messages": CHAT, "max_tokens": 3, "temperature": 0}),
    ]
    outs, log = run_batch(tmp_path, lines, "--model", model_path, "--served-model-name", "m", *ENGINE)
    assert [o["custom_id"] for o in outs] == ["chat-1", "cmpl-1", None, "bad-field", "embed-gen", "bad-url", "chat-2"]
    assert "100%" in log and "7 line(s), 4 failed" in log  # the progress bar, the summary
    by_id = {o["custom_id"]: o for o in outs}
    llm = LLM(model=model_path, dtype="float32", max_model_len=256, num_kv_blocks=64)
    greedy = lambda n: SamplingParams(temperature=0, max_tokens=n)  # noqa: E731
    assert by_id["chat-1"]["error"] is None and by_id["chat-1"]["response"]["status_code"] == 200
    assert by_id["chat-1"]["response"]["body"]["choices"][0]["message"]["content"] == \
        llm.chat(CHAT, greedy(6))[0].outputs[0].text
    assert by_id["chat-2"]["response"]["body"]["choices"][0]["message"]["content"] == \
        llm.chat(CHAT, greedy(3))[0].outputs[0].text
    assert by_id["cmpl-1"]["response"]["body"]["choices"][0]["text"] == \
        llm.generate("The sky is", greedy(6))[0].outputs[0].text
    assert outs[2]["response"] is None and "line 3: not JSON" in outs[2]["error"]["message"]
    bad = by_id["bad-field"]
    assert bad["response"]["status_code"] == 400 and bad["error"]["code"] == "unknown_parameter"
    assert "max_tokenz" in bad["error"]["message"] and bad["response"]["body"]["error"]["param"] == "max_tokenz"
    assert by_id["embed-gen"]["response"]["status_code"] == 400 and "pooling" in by_id["embed-gen"]["error"]["message"]
    assert by_id["bad-url"]["response"] is None and "/v1/files" in by_id["bad-url"]["error"]["message"]


def test_embedding_lines(tmp_path):
    from sentence_transformers import SentenceTransformer

    texts = ["The cat sits on the mat.", "Stock markets fell sharply today."]
    lines = [line(f"e{i}", "/v1/embeddings", {"model": "mini", "input": t}) for i, t in enumerate(texts)]
    outs, _ = run_batch(tmp_path, lines, "--model", minilm_path(), "--served-model-name", "mini", "--dtype",
                        "float32", "--num-threads", "1", "--disable-progress-bar")
    got = np.array([o["response"]["body"]["data"][0]["embedding"] for o in outs], dtype=np.float32)
    ref = SentenceTransformer(minilm_path(), device="cpu").encode(texts, convert_to_numpy=True)
    np.testing.assert_allclose(got, ref, atol=1e-4)
