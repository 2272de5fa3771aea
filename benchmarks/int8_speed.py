"""quantization="int8" against the unquantized engine: CPU seconds for one workload, both engines in one process.

    .venv/bin/python benchmarks/int8_speed.py [--dtype bfloat16] [--threads 1] [--num-prompts 64]

CPU time of the process (``time.process_time``), not wall time: at one thread it is what the work costs,
whatever else the machine runs (wall time on a shared 2-core box moved 40% between identical rounds).
The engines take turns for ``--rounds`` rounds; the best of each is compared, and the greedy tokens of
each prompt are compared up to their first divergence.
"""
from __future__ import annotations

import argparse
import logging
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    logging.disable(logging.WARNING)
    from vllite_core import LLM, SamplingParams
    from vllite_core.benchmarks.datasets import random_token_ids

    kw = {"model": a.model} if a.model else {}
    prompts = [{"prompt_token_ids": list(p)} for p in random_token_ids(a.num_prompts, a.input_len, 0, 49152)]
    sp = SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True)
    engines = {q: LLM(**kw, dtype=a.dtype, quantization=q, max_model_len=a.input_len + a.output_len + 16,
                      max_num_seqs=a.num_prompts, enable_prefix_caching=False, num_threads=a.threads)
               for q in (None, "int8")}
    for llm in engines.values():
        llm.generate(prompts[:2], sp)  # warm-up: packing, first touches
    best = {q: float("inf") for q in engines}
    outs = {}
    for r in range(a.rounds):
        for q, llm in engines.items():
            t = time.process_time()
            outs[q] = llm.generate(prompts, sp)
            cpu = time.process_time() - t
            best[q] = min(best[q], cpu)
            print(f"round {r} {q or a.dtype}: {cpu:.2f} CPU s", flush=True)
    agree = [next((i for i, (x, y) in enumerate(zip(b.outputs[0].token_ids, c.outputs[0].token_ids)) if x != y),
                  a.output_len) for b, c in zip(outs[None], outs["int8"])]
    print(f"int8 / {a.dtype}: {best[None] / best['int8']:.2f}x faster (CPU time, best of {a.rounds}); "
          f"greedy tokens before the first divergence: {sum(agree)} of {len(agree) * a.output_len}")


if __name__ == "__main__":
    main()
