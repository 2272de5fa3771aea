"""A small soak (benchmarks/soak.py) against a real `vllite serve` on a tiny random Llama under KV
pressure: 60 mixed requests (streams, n > 1, logprobs, stop strings, priorities, client aborts,
mid-stream disconnects, issue 58's attacks, each a 400); nothing lost or hung, no 5xx, the canary
never failed, every KV block back, the server healthy after.
No wall-clock or memory asserts (the machine is shared)."""
from __future__ import annotations

import sys
from pathlib import Path

from tiny_models import TINY

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import soak  # noqa: E402
from server_harness import ServerProcess  # noqa: E402

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # ids within the tiny vocabulary


def _small_words(path: str) -> list[str]:
    """Words whose tokens are all inside the tiny model's 512-id vocabulary."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    words = [w for w in (tok.decode([i]).strip() for i in range(200, 512)) if w.isalpha() and len(w) > 1]
    ok = [w for w in words if all(t < TINY["vocab_size"] for t in tok(" ".join([w, w]))["input_ids"])]
    assert len(ok) > 20
    return ok


def test_small_soak_loses_nothing_and_returns_blocks(tiny_path):
    server = ServerProcess([tiny_path, "--dtype", "float32", "--num-gpu-blocks-override", "24",
                          "--max-num-batched-tokens", "64", "--scheduling-policy", "priority",
                            "--trust-request-chat-template", "--chat-template-timeout", "1"])
    try:
        url = server.wait_ready()
        report = soak.soak(url, server.proc.pid, requests=60, warmup=5, concurrency=8, seed=1, priority=True,
                           chat_template=TEMPLATE, vocab=TINY["vocab_size"], max_tokens=12, timeout_s=120,
                           words=_small_words(tiny_path), abort_within_s=0.05, attacks=0.1)
    finally:
        rc = server.stop()
    print(report)
    assert report["lost"] == 0 and report["hung"] == 0, report["lost_examples"]
    assert report["warmup_lost"] == 0
    assert report["blocks_back"] and report["kv_free_blocks"] == report["kv_total_blocks"] > 0
    assert report["healthy_after"] and report["ok"]
    assert report["completed"] + report["aborted_by_client"] + report["disconnected"] + report["refused_attacks"] == 60
    assert report["refused_attacks"] > 0 and report["five_xx"] == 0 and not report["canary_failures"]
    assert report["aborted_by_client"] > 0 and report["disconnected"] > 0
    assert rc == 0, server.output
