"""`vllite bench {throughput,latency,serve}` and benchmarks/compare.py run and produce well-formed results.

Tiny workloads on a tiny random model (and a fake streaming server): no timing assertions.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading

import pytest
from tiny_models import TINY, save_tiny
from transformers import LlamaConfig

from vllite_core.benchmarks.datasets import load_dataset, random_token_ids
from vllite_core.benchmarks.report import format_table, percentiles
from vllite_core.entrypoints.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENGINE = ["--num-kv-blocks", "64", "--max-model-len", "128", "--dtype", "float32"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny(path, LlamaConfig(**TINY, architectures=["LlamaForCausalLM"]))
    return str(path)


def test_workload_is_the_peers_one():
    import numpy as np

    ids = random_token_ids(3, 5, seed=0)
    ref = np.random.RandomState(0).randint(17, 49152, size=(3, 5)).tolist()
    assert ids == ref
    small = random_token_ids(2, 50, seed=1, vocab_size=512)
    assert all(17 <= t < 512 for row in small for t in row)


def test_percentiles_and_table():
    p = percentiles([1.0, 2.0, 3.0, 4.0])
    assert p["p50"] == 2.5 and p["min"] == 1.0 and p["max"] == 4.0 and abs(p["p99"] - 3.97) < 1e-9
    assert percentiles([]) == {}
    text = format_table([["a", 1.5, None]], ["name", "x", "y"], "t")
    assert "== t ==" in text and "1.50" in text and "-" in text


def test_dataset_file(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"prompt_token_ids": [5, 6, 7]}) + "\n" + json.dumps({"prompt": "hi", "output_len": 3})
                 + "\n")
    reqs = load_dataset(str(f), None, 9)
    assert reqs[0].prompt_token_ids == [5, 6, 7] and reqs[0].output_len == 9
    assert reqs[1].prompt == "hi" and reqs[1].output_len == 3


def test_bench_throughput(tiny, tmp_path, capsys):
    out = tmp_path / "tp.json"
    rc = main(["bench", "throughput", "--model", tiny, "--num-prompts", "6", "--input-len", "12", "--output-len", "5",
               "--repeats", "2", "--output-json", str(out), *ENGINE])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["num_requests"] == 6 and res["output_tokens"] == 30 and res["prompt_tokens"] == 72
    for key in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s"):
        assert res[key] > 0
    assert len(res["runs_elapsed_s"]) == 2
    prof = res["step_profile"]["all"]
    assert prof["steps"] > 0 and set(prof["phases_s"]) == {"schedule", "prepare", "forward", "logits", "sample",
                                                           "output"}
    assert 0.0 <= prof["overhead_fraction"] <= 1.0
    assert "decode" in res["step_profile"]
    shown = capsys.readouterr().out
    assert "output tok/s" in shown and "overhead %" in shown


def test_bench_latency_sweep_and_plot(tiny, tmp_path):
    out, png = tmp_path / "lat.json", tmp_path / "lat.png"
    rc = main(["bench", "latency", "--model", tiny, "--batch-size", "1", "3", "--input-len", "8", "--output-len", "4",
               "--num-iters", "2", "--num-iters-warmup", "1", "--output-json", str(out), "--plot", str(png), *ENGINE])
    assert rc == 0
    res = json.loads(out.read_text())
    assert [r["batch_size"] for r in res["results"]] == [1, 3]
    for r in res["results"]:
        assert r["iters"] == 2 and r["e2e_s"]["p50"] > 0 and r["ms_per_output_token"] > 0 and r["ttft_ms"] > 0
    if res.get("plot"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class FakeOpenAI:
    """A tiny streaming /v1/completions server (asyncio, HTTP/1.1): one chunk per token, then usage."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()

    async def _handle(self, reader, writer) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                if path == "/v1/models":
                    data = json.dumps({"object": "list", "data": [{"id": "fake-model"}]}).encode()
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                                 + str(len(data)).encode() + b"\r\n\r\n" + data)
                    await writer.drain()
                    continue
                req = json.loads(body)
                self.requests.append(req)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                n = int(req["max_tokens"])

                async def send(obj) -> None:
                    raw = f"data: {obj}\n\n".encode()
                    writer.write(f"{len(raw):x}\r\n".encode() + raw + b"\r\n")
                    await writer.drain()

                for i in range(n):
                    await asyncio.sleep(0.002)
                    await send(json.dumps({"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}))
                prompt_len = len(req["prompt"]) if isinstance(req["prompt"], list) else 1
                await send(json.dumps({"choices": [], "usage": {"prompt_tokens": prompt_len,
                                                                "completion_tokens": n}}))
                await send("[DONE]")
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def test_bench_serve_against_fake_server(tmp_path):
    srv = FakeOpenAI()
    try:
        out, png = tmp_path / "serve.json", tmp_path / "serve.png"
        rc = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{srv.port}", "--num-prompts", "6",
                   "--input-len", "10", "--output-len", "5", "--request-rate", "200", "--max-concurrency", "1", "3",
                   "--no-progress", "--output-json", str(out), "--plot", str(png)])
    finally:
        srv.close()
    assert rc == 0
    res = json.loads(out.read_text())
    assert [r["max_concurrency"] for r in res["results"]] == [1, 3]
    for r in res["results"]:
        assert r["completed"] == 6 and r["failed"] == 0 and r["model"] == "fake-model"
        assert r["output_tokens"] == 30 and r["prompt_tokens"] == 60
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert set(r[key]) >= {"mean", "p50", "p90", "p99"}
        assert r["itl_ms"]["p50"] > 0 and r["output_tokens_per_s"] > 0
    req = srv.requests[0]
    assert req["stream"] is True and req["ignore_eos"] is True and len(req["prompt"]) == 10
    assert req["model"] == "fake-model"


def test_bench_serve_reports_failures(tmp_path):
    # Nothing listens on this port: every request fails, the command says so with a non-zero exit.
    out = tmp_path / "fail.json"
    rc = main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--served-model-name", "m", "--num-prompts",
               "2", "--input-len", "4", "--output-len", "2", "--no-progress", "--timeout", "5",
               "--output-json", str(out)])
    assert rc == 1
    res = json.loads(out.read_text())["results"][0]
    assert res["completed"] == 0 and res["failed"] == 2 and res["errors"]


def test_compare_script_vllite_only(tiny, tmp_path):
    """benchmarks/compare.py end to end with vllite alone (HF and vLLM need their model folders / venv)."""
    out = tmp_path / "cmp.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "compare.py"), "--engines", "vllite",
                           "--model", tiny, "--num-prompts", "3", "--input-len", "8", "--output-len", "4",
                           "--rounds", "1", "--max-model-len", "64", "--output-json", str(out)],
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, VLLITE_LOG_LEVEL="WARNING"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    e = res["engines"]["vllite"]
    assert e["throughput"]["output_tok_s"] > 0 and e["latency"]["ms_per_output_token"] > 0
    assert res["workload"]["num_prompts"] == 3 and "vllite x" in proc.stdout
