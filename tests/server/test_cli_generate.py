"""`vllite generate` end to end: the console script on the default model, JSONL in and out."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hf_reference import hf_greedy

pytestmark = pytest.mark.slow


def test_generate_jsonl_matches_hf(tmp_path, smollm2_hf):
    src = tmp_path / "in.jsonl"
    dst = tmp_path / "out.jsonl"
    ids = [1, 9690, 198, 2683, 359, 253]
    src.write_text(json.dumps({"prompt_token_ids": ids}) + "\n" + json.dumps({"prompt": "Hello, my name is"}) + "\n")
    env = dict(os.environ, VLLITE_LOG_LEVEL="WARNING")
    proc = subprocess.run([sys.executable, "-m", "vllite_core.entrypoints.cli", "generate", "--input", str(src),
                           "--output", str(dst), "--max-tokens", "12", "--ignore-eos", "--dtype", "float32",
                           "--max-model-len", "256"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert len(rows) == 2 and all(r["finish_reason"] == "length" for r in rows)
    assert rows[0]["token_ids"] == hf_greedy(smollm2_hf, ids, 12)
    assert rows[1]["prompt"] == "Hello, my name is" and len(rows[1]["token_ids"]) == 12


def test_generate_without_prompts_is_a_clear_error():
    proc = subprocess.run([sys.executable, "-m", "vllite_core.entrypoints.cli", "generate"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "give prompts" in proc.stderr
