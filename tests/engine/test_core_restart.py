"""A dead engine core comes back (issue 58, item 6), against a real server on 127.0.0.1.

kill -9 of the engine-core process: the open streams end with an ``engine_dead`` error event, /health
answers 503 (``engine_restarting``) while the core starts again, then 200, and a greedy completion
equals the one from before the kill; requests that arrive while it restarts wait for it
(--engine-restart-queue-size of them: served once it is back), the one over the queue gets 503 with
Retry-After (the new core process is held stopped until the third is refused: ordering, not timing);
a second kill past ``--engine-restart-max 1`` makes the server
exit non-zero (the budget spent, as with restarts off: tests/engine/test_fault_isolation.py)."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest
from server_harness import ServerProcess

from vllite_core.engine.restart import RestartPolicy

pytestmark = pytest.mark.slow


def core_pids(server_pid: int) -> list[int]:
    """The engine-core processes: the server's multiprocessing-spawned children (not the template
    renderers, not the resource tracker)."""
    out = []
    for child in psutil.Process(server_pid).children():
        try:
            if any("spawn_main" in part for part in child.cmdline()):
                out.append(child.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def one_core(server_pid: int, old: int | None = None, timeout: float = 120.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = [p for p in core_pids(server_pid) if p != old]
        if len(pids) == 1:
            return pids[0]
        time.sleep(0.1)
    raise AssertionError(f"no single engine-core process under {server_pid}: {core_pids(server_pid)}")


GREEDY = {"prompt": [5, 6, 7, 8], "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 0}


def greedy(url: str, model: str) -> list[str]:
    r = httpx.post(url + "/v1/completions", json=GREEDY | {"model": model}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


class Stream(threading.Thread):
    """One streamed completion: its events, whether a token arrived, how it ended."""

    def __init__(self, url: str, model: str, i: int) -> None:
        super().__init__(daemon=True)
        self.url, self.model, self.i = url, model, i
        self.events: list[dict] = []
        self.got_token = threading.Event()
        self.done = False
        self.failure: BaseException | None = None

    def run(self) -> None:
        body = {"model": self.model, "prompt": [9 + self.i, 10, 11], "max_tokens": 240, "temperature": 0,
                "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        self.done = True
                        break
                    event = json.loads(line[6:])
                    self.events.append(event)
                    if event.get("choices") and event["choices"][0].get("text"):
                        self.got_token.set()
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            self.failure = e

    @property
    def finished_normally(self) -> bool:
        return any(c.get("finish_reason") == "length" for e in self.events for c in e.get("choices", []))

    @property
    def error(self) -> dict | None:
        return next((e["error"] for e in self.events if "error" in e), None)


def health_codes_until_ok(url: str, timeout: float) -> list[int]:
    codes = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            codes.append(httpx.get(url + "/health", timeout=5).status_code)
        except httpx.HTTPError:
            codes.append(0)
        if codes[-1] == 200:
            return codes
        time.sleep(0.1)
    raise AssertionError(f"/health never answered 200 again in {timeout} s: {codes[-5:]}")


def test_killed_core_restarts_then_budget_ends_the_server(tiny_path):
    srv = ServerProcess(["--model", tiny_path, "--dtype", "float32", "--num-kv-blocks", "128",
                         "--engine-restart-max", "1", "--engine-restart-queue-size", "2",
                         "--engine-restart-queue-timeout", "600"])  # a restart on a loaded host can take minutes
    try:
        url = srv.wait_ready(timeout=900)
        before = greedy(url, tiny_path)
        core = one_core(srv.proc.pid)
        streams = [Stream(url, tiny_path, i) for i in range(3)]
        for s in streams:
            s.start()
        for s in streams:
            assert s.got_token.wait(120), (s.failure, srv.output[-2000:])
        os.kill(core, signal.SIGSTOP)  # hold the streams where they are, then kill the core
        open_streams = [s for s in streams if not s.finished_normally]
        os.kill(core, signal.SIGKILL)
        for s in streams:
            s.join(60)
        assert open_streams, "every stream finished before the kill"
        for s in open_streams:
            assert s.failure is None and s.done, (s.failure, s.events[-2:])
            assert s.error is not None and s.error["code"] == "engine_dead", s.events[-2:]
            assert "killed by signal SIGKILL" in s.error["message"]
        new_core = one_core(srv.proc.pid, old=core)
        os.kill(new_core, signal.SIGSTOP)  # it cannot be ready until the newcomers below have queued
        try:
            r = httpx.get(url + "/health", timeout=10)
            assert r.status_code == 503 and "engine_restarting" in r.text, r.text
            late: list = [None] * 3

            def send(i: int) -> None:
                r = httpx.post(url + "/v1/completions", json=GREEDY | {"model": tiny_path}, timeout=700)
                late[i] = r
            senders = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(3)]
            for t in senders:
                t.start()
            deadline = time.monotonic() + 120
            while not any(x is not None and x.status_code != 200 for x in late) and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            os.kill(new_core, signal.SIGCONT)
        for t in senders:
            t.join(700)
        refused = [r for r in late if r.status_code != 200]
        assert len(refused) == 1, [(r.status_code, r.text) for r in late]
        assert refused[0].status_code == 503 and refused[0].headers["retry-after"] == "5", refused[0].text
        assert refused[0].json()["error"]["code"] == "engine_restarting", refused[0].text
        served = [r.json()["choices"][0]["logprobs"]["tokens"] for r in late if r.status_code == 200]
        assert served == [before] * 2  # they waited for the restart, then were served
        health_codes_until_ok(url, timeout=600)
        r = httpx.get(url + "/metrics", timeout=10)
        assert 'vllite:engine_core_restarts_total{model_name="' in r.text
        assert [ln for ln in r.text.splitlines() if ln.startswith("vllite:engine_core_restarts_total")][0].endswith(
            " 1.0")
        assert one_core(srv.proc.pid, old=core) == new_core
        assert greedy(url, tiny_path) == before  # the restarted core serves the same model
        os.kill(new_core, signal.SIGKILL)  # the budget (1) is spent: the server exits non-zero
        rc = srv.proc.wait(timeout=60)
    finally:
        srv.stop()
    assert rc != 0, srv.output[-3000:]
    assert "vllite serve: the engine died" in srv.output and "SIGKILL" in srv.output


def test_restart_policy_budget_and_backoff():
    p = RestartPolicy(max_restarts=3, window_s=100.0, backoff_s=1.0, backoff_max_s=3.0)
    assert p.next_delay(0.0) == 1.0
    p.record(0.0)
    assert p.next_delay(1.0) == 2.0
    p.record(1.0)
    assert p.next_delay(2.0) == 3.0  # 4 s capped at backoff_max_s
    p.record(2.0)
    assert p.next_delay(3.0) is None  # 3 restarts within the window: no more
    assert p.next_delay(100.5) == 3.0  # the first one left the window: one more, after 2 x 2 x backoff (capped)
    assert RestartPolicy(max_restarts=0).next_delay(0.0) is None


def _run_all(engine, prompts: list[list[int]], tag: str) -> dict[int, list[int]]:
    from vllite_core import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", {"prompt_token_ids": p}, params)
    out: dict[int, list[int]] = {}
    deadline = time.monotonic() + 120
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        for o in engine.step():
            if o.finished:
                out[int(o.request_id[len(tag):])] = list(o.outputs[0].token_ids)
    return out


def test_data_parallel_restart_brings_back_only_the_dead_core(tiny_path):
    """Two engine cores; engine 1 killed mid-request: the step raises EngineDeadError naming it, restart
    starts engine 1 alone (engine 0 keeps its pid), and both serve the same greedy tokens as before."""
    from vllite_core.config import EngineArgs
    from vllite_core.engine.llm_engine import LLMEngine
    from vllite_core.engine.mp_client import MPClient
    from vllite_core.errors import EngineDeadError

    client = MPClient(EngineArgs.from_kwargs(model=tiny_path, dtype="float32", num_kv_blocks=64).create_config(), 2)
    try:
        engine = LLMEngine(client.info.config, core=client)
        prompts = [[3 + i, 4, 5, 6] for i in range(4)]
        before = _run_all(engine, prompts, "a")
        assert len(before) == 4
        pid0, pid1 = client.engines[0].pid, client.engines[1].pid
        engine.add_request("x", {"prompt_token_ids": [7, 8, 9]}, None)
        os.kill(pid1, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match=r"engine core 1 .* killed by signal SIGKILL"):
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                engine.step()
        engine.restart_core()
        assert client.engines[0].pid == pid0 and client.engines[1].pid not in (None, pid1)
        assert not engine.has_unfinished_requests() or _drained(engine)
        assert _run_all(engine, prompts, "b") == before
        assert all(e.stats.step_times.steps > 0 for e in client.engines)  # both engines served again
    finally:
        client.close()


def _drained(engine) -> bool:
    """The live engine's answer to the aborts restart sent comes back within a few steps."""
    deadline = time.monotonic() + 30
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        engine.step()
    return not engine.has_unfinished_requests()
