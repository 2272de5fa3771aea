"""cProfile of engine steps on the benchmark workload: where a decode (or prefill) step's time goes.

    .venv/bin/python benchmarks/profile_steps.py --model /tmp/peers/models/smollm2-135m --dtype bfloat16
    .venv/bin/python benchmarks/profile_steps.py --batch 1 --steps 100

One warm-up pass of the whole workload, then the workload again: the first steps
(prefill) run unprofiled unless --prefill, then --steps steps are profiled and the
functions with the most own time printed. cProfile adds per-call overhead, so the
ms/step it prints is above an unprofiled run's; read it for the split.
"""
from __future__ import annotations

import argparse
import cProfile
import logging
import os
import pstats
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--quantization", default=None, help="e.g. gguf, int8")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prefill", action="store_true", help="profile the first steps (prefill) instead")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: the engine's, all cores)")
    ap.add_argument("--kv-cache-dtype", default=None, help="e.g. fp8")
    a = ap.parse_args()
    logging.disable(logging.WARNING)
    from vllite_core import LLM, SamplingParams
    from vllite_core.benchmarks.datasets import random_token_ids

    kw = {"model": a.model} if a.model else {}
    if a.threads:
        kw["num_threads"] = a.threads
    if a.quantization:
        kw["quantization"] = a.quantization
    if a.kv_cache_dtype:
        kw["kv_cache_dtype"] = a.kv_cache_dtype
    llm = LLM(**kw, dtype=a.dtype, max_model_len=a.input_len + a.output_len + 16, max_num_seqs=a.batch,
              enable_prefix_caching=False)
    engine = llm.llm_engine
    prompts = random_token_ids(a.batch, a.input_len)
    from vllite_core.sampling_params import RequestOutputKind

    # FINAL_ONLY, as LLM.generate (compare.py) sets it: no output object per step
    params = SamplingParams(max_tokens=a.output_len, ignore_eos=True, temperature=0,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    prefill_steps = -(-a.batch * a.input_len // engine.config.scheduler_config.max_num_batched_tokens) + 1
    for rnd in range(2):
        for i, p in enumerate(prompts):
            engine.add_request(f"{rnd}-{i}", {"prompt_token_ids": p}, params)
        if rnd == 0:  # warm-up: the whole workload
            while engine.has_unfinished_requests():
                engine.step()
            continue
        if not a.prefill:
            for _ in range(prefill_steps):
                engine.step()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(a.steps):
            engine.step()
        prof.disable()
        print(f"{a.steps} steps, batch {a.batch}: {(time.perf_counter() - t0) * 1000 / a.steps:.1f} ms/step "
              f"(profiled)")
        while engine.has_unfinished_requests():
            engine.step()
    pstats.Stats(prof).sort_stats("tottime").print_stats(a.top)


if __name__ == "__main__":
    main()
