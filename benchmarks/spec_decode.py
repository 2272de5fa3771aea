"""Speculative decoding (ngram) against no speculation, side by side in one run, on SmolLM2-135M.

    .venv/bin/python benchmarks/spec_decode.py --max-tokens 96 --threads 2

Workloads:
- copy-heavy: prompts that hold the text the answer repeats ("rewrite this code with one change"),
  greedy, at batch 1 (one request at a time) and batch 16 (16 requests at once);
- random-token prompts, batch 16: greedy (a random prompt often sends a small model into a loop, which
  ngram then predicts well) and sampled at temperature 1 (little to match, and the matches are mostly
  rejected): what proposing and verifying costs when it rarely pays.
Prints output tokens per second of each engine, the ratio spec / no-spec, whether greedy outputs are
identical, and the acceptance counters. Wall-clock numbers: on a shared machine, repeat and compare ratios,
or pass ``--clock cpu`` (tokens per CPU second of the process, best with ``--threads 1``).
"""
from __future__ import annotations

import argparse
import json
import random
import time

CODE = [
    "def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n"
    "    return 2 * (width + height)\n\n\ndef describe(width, height):\n"
    "    return f\"{width}x{height}: area {area(width, height)}, perimeter {perimeter(width, height)}\"\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n\n"
    "    def is_empty(self):\n        return not self.items\n",
    "SELECT users.name, orders.total FROM users JOIN orders ON users.id = orders.user_id "
    "WHERE orders.total > 100 ORDER BY orders.total DESC LIMIT 10;\n",
    "The meeting is moved from Monday at 10 am to Tuesday at 11 am in room 4B. Please bring the quarterly "
    "report, the budget sheet and the slides for the new product launch.\n",
]
CHANGES = ["rename every variable to a longer name", "add a docstring to each function", "use double quotes",
           "keep everything the same but add a comment at the top"]


def copy_prompts(n: int) -> list[str]:
    return [f"Rewrite the following with one change ({CHANGES[i % len(CHANGES)]}). Repeat everything else "
            f"exactly.\n\n{CODE[i % len(CODE)]}\nRewritten:\n{CODE[i % len(CODE)][:40]}" for i in range(n)]


def random_prompts(n: int, vocab: int, length: int = 64) -> list[dict]:
    rng = random.Random(0)
    return [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(length)]} for _ in range(n)]


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def run(llm, prompts, sp, batch: int, clock: str = "wall"):
    """(token ids per request, output tokens per second of ``clock``), ``batch`` requests at a time."""
    now = CLOCKS[clock]
    t = now()
    outs = []
    for i in range(0, len(prompts), batch):
        outs += llm.generate(prompts[i:i + batch], sp)
    dt = now() - t
    return [o.outputs[0].token_ids for o in outs], sum(len(o.outputs[0].token_ids) for o in outs) / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=2, help="alternate no-spec / spec runs; the best of each counts")
    ap.add_argument("--workloads", default="copy_batch1,copy_batch16,random_greedy_batch16,random_sampled_batch16",
                    help="comma-separated subset to run")
    ap.add_argument("--enforce-eager", action="store_true", help="no graph capture for either engine")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="cpu: tokens per CPU second of this process (steadier than wall time on a shared host)")
    a = ap.parse_args()
    from vllite_core.entrypoints.llm import LLM
    from vllite_core.sampling_params import SamplingParams

    common = dict(dtype=a.dtype, num_threads=a.threads, enforce_eager=a.enforce_eager)
    spec_cfg = {"method": "ngram", "num_speculative_tokens": a.k, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    base = LLM(**common)
    spec = LLM(**common, speculative_config=spec_cfg)
    sp = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    copy = copy_prompts(a.requests)
    rand = random_prompts(a.requests, base.llm_engine.vocab_size)
    results = {}
    for llm in (base, spec):  # warm-up
        llm.generate(copy[:2], SamplingParams(temperature=0.0, max_tokens=8))
    sampled = SamplingParams(temperature=1.0, max_tokens=a.max_tokens, ignore_eos=True, seed=0)
    for name, prompts, batch, params in (("copy_batch1", copy[:4], 1, sp), ("copy_batch16", copy, 16, sp),
                                         ("random_greedy_batch16", rand, 16, sp),
                                         ("random_sampled_batch16", rand, 16, sampled)):
        if name not in a.workloads.split(","):
            continue
        before = spec.llm_engine.get_stats().spec_decoding
        tps_b = tps_s = 0.0
        for rep in range(a.repeats):  # alternated, so both engines see the same machine load on average
            out_b, tb = run(base, prompts, params, batch, a.clock)
            out_s, ts = run(spec, prompts, params, batch, a.clock)
            tps_b, tps_s = max(tps_b, tb), max(tps_s, ts)
            if rep == 0:
                after = spec.llm_engine.get_stats().spec_decoding  # the counters of one pass
        drafts, tokens = after.num_draft_tokens - before.num_draft_tokens, after.num_drafts - before.num_drafts
        acc = after.num_accepted_tokens - before.num_accepted_tokens
        results[name] = {"no_spec_tok_s": round(tps_b, 1), "ngram_tok_s": round(tps_s, 1),
                         "ratio": round(tps_s / tps_b, 3),
                         "identical": out_b == out_s if params.temperature == 0 else "n/a (sampled)",
                         "draft_tokens": drafts, "verification_rounds": tokens, "accepted": acc,
                         "acceptance_rate": round(acc / drafts, 3) if drafts else 0.0}
        print(name, json.dumps(results[name]), flush=True)
    import os

    print(json.dumps({"k": a.k, "max_tokens": a.max_tokens, "threads": a.threads, "repeats": a.repeats,
                      "clock": a.clock,
                      "enforce_eager": a.enforce_eager, "load_average": os.getloadavg(), "results": results}))


if __name__ == "__main__":
    main()
