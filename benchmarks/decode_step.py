"""Wall-clock time per output token of one request (batch-1 decode), split by engine phase.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/decode_step.py --threads 1 --steps 64 --rounds 3

One engine (default model, float32), one request of --input-len random ids decoding greedily; each round
times --steps decode steps with ``StepProfiler`` (schedule / prepare / forward / logits / sample / output,
see vllite_core/benchmarks/step_profile.py) and prints the medians per step. Compare two commits by
alternating runs of this script (PYTHONPATH pointing at each), several rounds each: the host is shared,
so only medians of alternated runs mean anything.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--quantization", default=None, help="e.g. gguf, int8")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output-json", default=None)
    a = ap.parse_args()
    logging.disable(logging.WARNING)
    from vllite_core import LLM, SamplingParams
    from vllite_core.benchmarks.datasets import random_token_ids
    from vllite_core.benchmarks.step_profile import PHASES, StepProfiler

    kw = {"model": a.model} if a.model else {}
    if a.threads:
        kw["num_threads"] = a.threads
    if a.quantization:
        kw["quantization"] = a.quantization
    llm = LLM(**kw, dtype=a.dtype, max_model_len=a.input_len + a.steps + 16, max_num_seqs=1,
              enable_prefix_caching=False)
    engine = llm.llm_engine
    prompt = random_token_ids(1, a.input_len)[0]
    params = SamplingParams(max_tokens=a.steps + 1, ignore_eos=True, temperature=0)
    prof = StepProfiler().attach(engine)
    rounds = []
    for rnd in range(a.rounds + 1):  # round 0 warms up
        engine.add_request(f"r{rnd}", {"prompt_token_ids": prompt}, params)
        engine.step()  # prefill
        prof.reset()
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        wall = (time.perf_counter() - t0) * 1000 / a.steps
        recs = [r for r in prof.records if r.is_decode]
        for r in recs:  # "output" is what the timers do not cover
            r.phases["output"] = r.total - sum(v for k, v in r.phases.items() if k != "output")
        med = {p: statistics.median(r.phases[p] for r in recs) * 1000 for p in PHASES}
        med["step"] = statistics.median(r.total for r in recs) * 1000
        if rnd:
            rounds.append({"ms_per_token": wall, **med})
            print(f"round {rnd}: {wall:.2f} ms/token; median step " +
                  " ".join(f"{k} {v:.2f}" for k, v in med.items()), flush=True)
    best = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    print("median of rounds: " + " ".join(f"{k} {v:.2f}" for k, v in best.items()))
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump({"args": vars(a), "rounds": rounds, "median": best}, f, indent=1)


if __name__ == "__main__":
    main()
