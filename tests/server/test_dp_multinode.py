"""Data parallelism across two "nodes" on 127.0.0.1, spelled as vLLM spells it (issue 59, items 2 and 4):
a head `vllite serve --data-parallel-size 2 --data-parallel-size-local 1 --data-parallel-address ...`
(API server + rank 0) and a `vllite serve --headless --data-parallel-start-rank 1` node (rank 1, whose
engine core connects to the head's front end), a tiny Llama, the real openai client.

- greedy tokens equal transformers' float32 ones and the one-process engine's, and requests land on
  both ranks (the per-engine request counters of /metrics);
- the remote rank's engine core killed mid-stream: its streams end with an error naming it, the local
  rank's streams finish with the tokens it serves afterwards, /health says the core restarts while new
  requests are served by rank 0; the headless node starts its core again and the head takes it back;
- rank 1's core stopped (SIGSTOP: a node that stops answering): the heartbeats drop its link, the same;
- the whole headless node killed mid-stream: the same (nothing restarts rank 1 until a new headless node is
  started, which the head takes back);
- the API server stopped and started again: the headless node's core stops with its link, starts again and
  connects to the new API server.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import httpx
import openai
import pytest
from hf_reference import hf_greedy
from server_harness import ServerProcess
from test_reliability_dp import MAX_TOKENS, Stream
from tiny_models import TINY, save_tiny

pytestmark = pytest.mark.slow

PROMPTS = [[11 + i, 12, 13 + 2 * i] for i in range(4)]
SHORT = 16  # tokens compared with transformers and the one-process engine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HeadlessNode:
    """`vllite serve --headless` in a process group of its own (killing the group is a node dying)."""

    def __init__(self, args: list[str]) -> None:
        env = dict(os.environ, VLLITE_LOG_LEVEL="WARNING", OMP_WAIT_POLICY="PASSIVE", HF_HUB_OFFLINE="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "vllite_core.entrypoints.cli", "serve", "--headless",
                                      *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def core_pid(self, rank: int, timeout: float = 60.0) -> int:
        """The latest engine-core pid it reported for ``rank``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.findall(rf"DP rank {rank} pid (\d+)\b(?! exited)", self.output)
            if found:
                return int(found[-1])
            time.sleep(0.2)
        raise AssertionError(self.output)

    def kill(self) -> None:
        """The node dies: SIGKILL to its launcher and engine cores at once."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tiny-llama-dp-nodes")
    model = save_tiny(path, LlamaConfig(**{**TINY, "max_position_embeddings": 4096},
                                        architectures=["LlamaForCausalLM"]))
    return str(path), model


@dataclass
class Cluster:
    head: ServerProcess
    node: HeadlessNode
    common: list[str]  # the options both were started with

    def start_head(self) -> ServerProcess:
        self.head = ServerProcess([*self.common, "--served-model-name", "tiny"])
        return self.head

    def start_node(self) -> HeadlessNode:
        self.node = HeadlessNode([*self.common, "--data-parallel-start-rank", "1"])
        return self.node


@pytest.fixture(scope="module")
def cluster(tiny):
    common = ["--model", tiny[0], "--dtype", "float32", "--max-num-seqs", "8", "--data-parallel-size", "2",
              "--data-parallel-size-local", "1", "--data-parallel-address", "127.0.0.1",
              "--data-parallel-rpc-port", str(free_port()), "--engine-restart-max", "5"]
    c = Cluster(None, None, common)  # type: ignore[arg-type]
    c.start_head()
    c.start_node()
    try:
        c.head.wait_ready(600)
        yield c
    finally:
        c.head.stop()
        c.node.kill()


@pytest.fixture
def client(cluster):
    return openai.OpenAI(base_url=cluster.head.url + "/v1", api_key="none", max_retries=0, timeout=300)


def served_per_engine(url: str) -> dict[str, float]:
    """Finished requests by engine (vLLM's engine label: the data-parallel rank), from /metrics."""
    text = httpx.get(url + "/metrics", timeout=30).text
    out: dict[str, float] = {}
    for engine, value in re.findall(r'^vllm:request_success_total\{engine="(\d+)",finished_reason="length"[^}]*\} '
                                    r'(\S+)$', text, re.M):
        out[engine] = out.get(engine, 0.0) + float(value)
    return out


def concurrently(fn, args: list) -> list:
    results: list = [None] * len(args)

    def run(i: int) -> None:
        results[i] = fn(args[i])
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(args))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return results


def greedy(client, prompt: list[int], max_tokens: int) -> str:
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    return out.choices[0].text


def wait_health(url: str, code: int, timeout: float) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(url + "/health", timeout=10)
        if r.status_code == code or time.monotonic() > deadline:
            return r
        time.sleep(0.1)


def test_two_nodes_serve_transformers_tokens_on_both_ranks(tiny, cluster, client):
    from vllite_core import LLM, SamplingParams

    path, model = tiny
    head, node = cluster.head, cluster.node
    assert re.search(r"DP rank 1 pid \d+ on 127\.0\.0\.1", head.output), head.output
    assert "headless node: DP rank 1 pid" in node.output and "no API server" in node.output
    hf = [hf_greedy(model, p, SHORT) for p in PROMPTS]
    llm = LLM(model=path, dtype="float32", num_kv_blocks=64)
    one = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                       SamplingParams(max_tokens=SHORT, temperature=0, ignore_eos=True))
    assert [list(o.outputs[0].token_ids) for o in one] == hf
    del llm
    before = served_per_engine(head.url)
    texts = concurrently(lambda p: greedy(client, p, SHORT), PROMPTS)
    # the same detokenizer as the one-process engine (a trailing partial UTF-8 character is held back)
    assert texts == [o.outputs[0].text for o in one]
    assert len(set(texts)) == len(PROMPTS)
    after = served_per_engine(head.url)
    landed = {e: after.get(e, 0) - before.get(e, 0) for e in ("0", "1")}
    assert landed["0"] > 0 and landed["1"] > 0 and sum(landed.values()) == len(PROMPTS), landed


def test_a_killed_remote_core_fails_only_its_requests_and_comes_back(cluster, client):
    head, node = cluster.head, cluster.node
    local = int(re.findall(r"DP rank 0 pid (\d+)", head.output)[-1])
    remote = node.core_pid(1)
    streams = [Stream(head.url, p) for p in PROMPTS]
    for s in streams:  # the front end sends each to the rank with fewer unfinished requests: 2 and 2
        s.start()
    for s in streams:
        assert s.got_token.wait(120)
    for pid in (local, remote):  # hold every stream where it is, then kill rank 1's core
        os.kill(pid, signal.SIGSTOP)
    assert not any(s.finish for s in streams), "a stream finished before the kill"
    os.kill(remote, signal.SIGKILL)
    os.kill(local, signal.SIGCONT)
    r = wait_health(head.url, 503, 30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_restarting", r.text
    assert "engine core 1" in r.json()["error"]["message"]
    for s in streams:
        s.join(300)
        assert not s.is_alive()
    dead = [s for s in streams if s.error is not None]
    live = [s for s in streams if s.error is None]
    assert len(dead) == 2 and len(live) == 2, [(s.finish, s.error) for s in streams]
    for s in dead:
        assert s.error["code"] == "engine_dead" and "engine core 1" in s.error["message"], s.error
    assert all(s.finish == "length" for s in live)
    # rank 0 serves on (rank 1 may still be loading): the same greedy text its streams had
    assert concurrently(lambda s: greedy(client, s.prompt, MAX_TOKENS), live) == [s.text for s in live]
    # the headless node starts rank 1 again; the head takes it back
    assert wait_health(head.url, 200, 300).status_code == 200, head.output + node.output
    assert node.core_pid(1) != remote
    metrics = httpx.get(head.url + "/metrics", timeout=30).text
    assert re.search(r"^vllite:engine_core_restarts_total\S* 1\.0$", metrics, re.M), metrics
    before = served_per_engine(head.url)
    concurrently(lambda p: greedy(client, p, 200), PROMPTS)
    after = served_per_engine(head.url)
    assert after.get("1", 0) > before.get("1", 0)


def test_a_remote_core_that_stops_answering_is_dropped_by_the_heartbeats(cluster, client):
    """SIGSTOP: its link stays open (no FIN, as with a node cut off or frozen); only the missing heartbeat
    answers (10 s) close it. Once resumed, the core finds its link closed and stops; its node starts it again."""
    head, node = cluster.head, cluster.node
    remote = node.core_pid(1)
    streams = [Stream(head.url, p) for p in PROMPTS[:2]]  # one on each rank
    for s in streams:
        s.start()
    for s in streams:
        assert s.got_token.wait(120)
    os.kill(remote, signal.SIGSTOP)
    try:
        r = wait_health(head.url, 503, 120)
        assert r.status_code == 503 and "engine core 1" in r.json()["error"]["message"], r.text
        for s in streams:
            s.join(300)
            assert not s.is_alive()
    finally:
        os.kill(remote, signal.SIGCONT)
    dead = [s for s in streams if s.error is not None]
    live = [s for s in streams if s.error is None]
    assert len(dead) == 1 and "engine core 1" in dead[0].error["message"], [(s.finish, s.error) for s in streams]
    assert live[0].finish == "length"
    assert wait_health(head.url, 200, 300).status_code == 200, head.output + node.output
    assert node.core_pid(1) != remote


def test_a_node_killed_mid_stream_leaves_rank_0_serving_and_a_new_node_is_taken_back(cluster, client):
    head, node = cluster.head, cluster.node
    local = int(re.findall(r"DP rank 0 pid (\d+)", head.output)[-1])
    streams = [Stream(head.url, p) for p in PROMPTS[:2]]  # one on each rank
    for s in streams:
        s.start()
    for s in streams:
        assert s.got_token.wait(120)
    os.kill(local, signal.SIGSTOP)  # rank 0's stream stays open while the node dies
    node.kill()
    os.kill(local, signal.SIGCONT)
    r = wait_health(head.url, 503, 30)
    assert r.status_code == 503 and "engine core 1" in r.json()["error"]["message"], r.text
    for s in streams:
        s.join(300)
        assert not s.is_alive()
    dead = [s for s in streams if s.error is not None]
    live = [s for s in streams if s.error is None]
    assert len(dead) == 1 and "engine core 1" in dead[0].error["message"], [(s.finish, s.error) for s in streams]
    assert live[0].finish == "length" and greedy(client, live[0].prompt, MAX_TOKENS) == live[0].text
    ref = greedy(client, PROMPTS[0], 32)
    assert concurrently(lambda p: greedy(client, p, 32), [PROMPTS[0]] * 2) == [ref, ref]  # both on rank 0
    assert httpx.get(head.url + "/health", timeout=10).status_code == 503  # no node runs rank 1
    new = cluster.start_node()
    assert wait_health(head.url, 200, 300).status_code == 200, head.output + new.output
    before = served_per_engine(head.url)
    assert concurrently(lambda p: greedy(client, p, 32), [PROMPTS[0]] * 4) == [ref] * 4
    assert served_per_engine(head.url).get("1", 0) > before.get("1", 0)


def test_a_restarted_api_server_gets_the_headless_ranks_back(cluster):
    """The node outlives its API server: its core stops with the link and starts again, and connects to the
    new API server on the same address and port."""
    old_core = cluster.node.core_pid(1)
    cluster.head.stop()
    head = cluster.start_head()
    head.wait_ready(600)
    assert cluster.node.core_pid(1) != old_core, cluster.node.output
    assert f"DP rank 1 pid {old_core} exited (exit code 0)" in cluster.node.output  # it stopped, no crash
    client = openai.OpenAI(base_url=head.url + "/v1", api_key="none", max_retries=0, timeout=300)
    ref = greedy(client, PROMPTS[1], 32)
    before = served_per_engine(head.url)
    assert concurrently(lambda p: greedy(client, p, 32), [PROMPTS[1]] * 4) == [ref] * 4
    after = served_per_engine(head.url)
    assert after.get("0", 0) > before.get("0", 0) and after.get("1", 0) > before.get("1", 0)
