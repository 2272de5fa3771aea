"""quantization="gguf" (the GGUF blocks computed as they are) against the dequantised engines: float32 (the
default), bfloat16 and int8, all in one process, taking turns.

    .venv/bin/python benchmarks/gguf_speed.py [--threads 2] [--rounds 3] [--engines fp32,bf16,gguf,gguf-bf16,int8]

(gguf-bf16: the blocks under a bfloat16 model: bf16 activations and KV cache, bf16 panels for many rows.)

Batch 1: ms per output token of one request (a 16-token prompt): the time of 65 output tokens less the time
of 1, over 64. Batches 16 and 64: output tok/s of that many requests of ``--input-len`` prompt and
``--output-len`` output tokens (default 128 and 32) at once, prefill included. Wall time, best of ``--rounds``
(each round runs every engine once per measure, in turn), with the load average before and after: the machine
is shared, so only ratios inside one run mean anything. Greedy tokens of the first batch's requests are
compared with the float32 engine's up to the first divergence.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ENGINES = {"fp32": ("float32", None), "bf16": ("bfloat16", None), "int8": ("float32", "int8"),
           "gguf": ("float32", "gguf"), "gguf-bf16": ("bfloat16", "gguf")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--engines", default="fp32,bf16,gguf")  # + int8 where torch._int_mm is fast (VNNI)
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--output-json", default=None)
    a = ap.parse_args()
    logging.disable(logging.WARNING)
    from vllite_core import LLM, SamplingParams
    from vllite_core.benchmarks.datasets import random_token_ids

    names = a.engines.split(",")
    batches = [int(b) for b in a.batches.split(",")]
    engines = {}
    for n in names:
        dtype, q = ENGINES[n]
        t = time.perf_counter()
        engines[n] = LLM(dtype=dtype, quantization=q, max_model_len=a.input_len + max(a.output_len, 65) + 16,
                         max_num_seqs=max(batches), enable_prefix_caching=False, num_threads=a.threads)
        print(f"{n}: started in {time.perf_counter() - t:.1f} s", flush=True)
    one = [{"prompt_token_ids": list(random_token_ids(1, 16, 1, 49152)[0])}]
    many = [{"prompt_token_ids": list(p)} for p in random_token_ids(max(batches), a.input_len, 0, 49152)]

    def sp(n: int) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    for llm in engines.values():
        llm.generate(many[:4], sp(4))  # warm-up: packing, first touches
    ms = {n: float("inf") for n in names}
    cpu_ms = {n: float("inf") for n in names}  # the process's CPU time: what the machine's load does not inflate
    tps = {(n, b): 0.0 for n in names for b in batches}
    outs = {}
    load_before = os.getloadavg()
    for r in range(a.rounds):
        for n, llm in engines.items():
            t0, c0 = time.perf_counter(), time.process_time()
            llm.generate(one, sp(1))
            t1, c1 = time.perf_counter(), time.process_time()
            llm.generate(one, sp(65))
            t2, c2 = time.perf_counter(), time.process_time()
            ms[n] = min(ms[n], ((t2 - t1) - (t1 - t0)) / 64 * 1e3)
            cpu_ms[n] = min(cpu_ms[n], ((c2 - c1) - (c1 - c0)) / 64 * 1e3)
        for b in batches:
            for n, llm in engines.items():
                t = time.perf_counter()
                res = llm.generate(many[:b], sp(a.output_len))
                tps[n, b] = max(tps[n, b], b * a.output_len / (time.perf_counter() - t))
                if b == batches[0]:
                    outs[n] = [o.outputs[0].token_ids for o in res]
        print(f"round {r}: " + ", ".join(f"{n} {ms[n]:.1f} ms/tok" for n in names), flush=True)
    load_after = os.getloadavg()
    ref = "fp32" if "fp32" in names else names[0]
    rows = []
    for n in names:
        agree = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), len(p)) for p, q in zip(outs[ref], outs[n])]
        rows.append({"engine": n, "ms_per_token_batch1": round(ms[n], 2),
                     "cpu_ms_per_token_batch1": round(cpu_ms[n], 2),
                     **{f"tok_s_batch{b}": round(tps[n, b], 1) for b in batches},
                     "greedy_agreement": f"{sum(agree)}/{a.output_len * len(agree)}"})
    print(f"threads {a.threads}, best of {a.rounds}, load average {load_before[0]:.1f} -> {load_after[0]:.1f}")
    print("| engine | ms/token, batch 1 (CPU ms) | " + " | ".join(f"tok/s, batch {b}" for b in batches)
          + f" | greedy tokens = {ref}'s (batch {batches[0]}) |")
    print("|---|---|" + "---|" * len(batches) + "---|")
    for row in rows:
        print(f"| {row['engine']} | {row['ms_per_token_batch1']} ({row['cpu_ms_per_token_batch1']}) | "
              + " | ".join(str(row[f'tok_s_batch{b}']) for b in batches) + f" | {row['greedy_agreement']} |")
    if "gguf" in names:
        for n in names:
            if n != "gguf":
                print(f"gguf / {n}: batch 1 {ms[n] / ms['gguf']:.2f}x faster; "
                      + ", ".join(f"batch {b} {tps['gguf', b] / tps[n, b]:.2f}x" for b in batches))
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump({"threads": a.threads, "rounds": a.rounds, "load_average": [load_before, load_after],
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
