"""Tensor parallelism on this machine: SmolLM2-135M (fp32) with tensor_parallel_size=2 (mp executor, two
worker processes, gloo) against one rank (uni executor), same workload, one run.

    .venv/bin/python benchmarks/tensor_parallel.py [--requests 16 --prompt-len 128 --output-len 64]

Each engine gets the same random prompts (greedy, ignore_eos); the first generate warms it up, the
second is timed: offline throughput (output tokens/s) and the time of one request alone (time per
output token). Both configurations get all the machine's cores: one rank uses them all, two ranks
one share each (the CPU platform divides the cores among a host's ranks). Tokens of the two are
checked equal. On a small CPU host TP=2 is expected to be slower: each layer adds two all-reduces
through gloo (process-to-process copies) for matmuls that are already small; TP is the path to
models and machines one device cannot hold.
"""
from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _run(tp: int, prompts: list[list[int]], a: argparse.Namespace) -> dict:
    from vllite_core import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(dtype="float32", max_model_len=a.prompt_len + a.output_len + 16, tensor_parallel_size=tp,
              num_kv_blocks=len(prompts) * (-(-(a.prompt_len + a.output_len) // 16)) + 8)
    startup = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=a.output_len, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(batch[:2], params)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(batch, params)
    batch_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.generate(batch[:1], params)
    single_s = time.perf_counter() - t0
    llm.llm_engine.core.shutdown()
    return {"tensor_parallel_size": tp, "executor": "uni" if tp == 1 else "mp", "startup_s": round(startup, 1),
            "output_tok_per_s": round(len(prompts) * a.output_len / batch_s, 1),
            "single_request_tpot_ms": round(1000 * single_s / a.output_len, 1),
            "tokens": [o.outputs[0].token_ids for o in outs]}


def main() -> None:
    import numpy as np

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    a = p.parse_args()
    rs = np.random.RandomState(0)
    prompts = [rs.randint(17, 49152, size=a.prompt_len).tolist() for _ in range(a.requests)]
    results = [_run(tp, prompts, a) for tp in (1, 2)]
    same = results[0].pop("tokens") == results[1].pop("tokens")
    print(json.dumps({"cpus": len(os.sched_getaffinity(0)), "workload": vars(a), "results": results,
                      "tokens_identical": same,
                      "tp2_over_tp1_throughput": round(results[1]["output_tok_per_s"]
                                                       / results[0]["output_tok_per_s"], 2)}, indent=2))


if __name__ == "__main__":
    main()
