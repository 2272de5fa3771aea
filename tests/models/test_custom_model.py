"""examples/custom_model: a new decoder-only architecture added by an installed plugin package, used by
`vllite generate --model DIR` with no change to vllite; greedy tokens identical to transformers' Llama on the
same weights."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from hf_reference import hf_greedy
from tiny_models import TINY, save_tiny


def _save_my_llama(path):
    from transformers import LlamaConfig

    hf = save_tiny(path, LlamaConfig(**TINY), seed=4)  # transformers' LlamaForCausalLM: the reference
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["MyLlamaForCausalLM"]  # an architecture only the example plugin knows
    (path / "config.json").write_text(json.dumps(config))
    return hf


def test_plugin_registers_the_architecture():
    from model_registry.registry import build_registry
    from vllite_core.plugins.manager import get_plugin_manager, list_plugins

    info = next(i for i in list_plugins() if i.distribution == "vllite-example-custom-model")
    assert info.status == "loaded" and info.group == "vllite.plugins" and info.name == "my-llama"
    entry = build_registry(get_plugin_manager()).entry("MyLlamaForCausalLM")
    assert entry.plugin == "vllite-example-custom-model"


def test_vllite_generate_uses_the_custom_model(tmp_path):
    model_dir = tmp_path / "my-llama"
    hf = _save_my_llama(model_dir)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, TINY["vocab_size"], (n,), generator=gen).tolist() for n in (4, 19, 37)]
    ref = [hf_greedy(hf, p, 12) for p in prompts]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    script = os.path.join(os.path.dirname(sys.executable), "vllite")
    cmd = [script] if os.path.exists(script) else [sys.executable, "-m", "vllite_core.entrypoints.cli"]
    proc = subprocess.run([*cmd, "generate", "--model", str(model_dir), "--input", str(src), "--output", str(dst),
                           "--max-tokens", "12", "--ignore-eos", "--dtype", "float32", "--num-kv-blocks", "64"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "VLLITE_LOG_LEVEL": "INFO"})
    assert proc.returncode == 0, proc.stderr
    assert "engine ready: MyLlamaForCausalLM" in proc.stderr  # the plugin's architecture served the run
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["token_ids"] for r in rows] == ref
