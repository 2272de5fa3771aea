#!/usr/bin/env python3
"""vllite against llama.cpp on the same GGUF file (issue 55): the Q4_K_M of the Llama-3.2-1B-shaped
checkpoint (``make_llama1b_gguf.py``), same threads, the peers' workload (``../shared/peers/workload.py``:
random token ids, no tokenization).

- batch 1: one 128-token prompt, 128 output tokens; ms per output token of the decode
  ((time of 128 tokens - time of 1) / 127) and the time to the first token;
- batch ``--batch``: that many such requests at once, output tokens per second (prefill included);
- memory: the engine process's resident set after start, against the file's size.

The engines run one after the other (llama.cpp first, in its own venv through the peers'
``bench_llama_cpp.py``, then vllite in this process): the host is shared, only ratios from one run mean much.

    .venv/bin/python benchmarks/gguf_vs_llama_cpp.py [--gguf /tmp/peers/models/llama1b-q4_k_m.gguf] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

PEERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "peers")
LLAMA_VENV = "/tmp/peers/llama-venv/bin/python"


def _rss_gib() -> float:
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 2**20


def run_vllite(a: argparse.Namespace, prompts: list[list[int]]) -> dict:
    from vllite_core import LLM, SamplingParams

    t = time.perf_counter()
    llm = LLM(model=a.gguf, quantization="gguf", dtype=a.dtype, max_model_len=a.in_len + a.out_len + 16,
              max_num_seqs=a.batch, enable_prefix_caching=False, num_threads=a.threads)
    load_s = time.perf_counter() - t

    tokens: list[int] = []

    def timed(batch: list[list[int]], n: int) -> float:
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], sp)
        tokens[:] = outs[0].outputs[0].token_ids
        return time.perf_counter() - t

    timed(prompts[:2], 4)  # warm-up
    first = min(timed(prompts[:1], 1) for _ in range(a.rounds))
    whole = min(timed(prompts[:1], a.out_len) for _ in range(a.rounds))
    first_tokens = tokens[:32]
    many = min(timed(prompts[:a.batch], a.out_len) for _ in range(a.rounds))
    return {"engine": f"vllite (quantization=gguf, {a.dtype} activations)", "load_s": round(load_s, 1),
            "ttft_ms": round(first * 1e3, 1), "ms_per_token": round((whole - first) / (a.out_len - 1) * 1e3, 2),
            f"batch{a.batch}_out_tok_s": round(a.batch * a.out_len / many, 1), "rss_gib": round(_rss_gib(), 2),
            "tokens": first_tokens}


def run_llama_cpp(a: argparse.Namespace) -> dict:
    out = os.path.join("/tmp/peers/tmp", f"llama_cpp_{os.getpid()}.json")
    cmd = [LLAMA_VENV, os.path.join(PEERS, "bench_llama_cpp.py"), "--gguf", a.gguf, "--threads", str(a.threads),
           "--n", str(a.batch), "--in-len", str(a.in_len), "--out-len", str(a.out_len), "--repeats", "1",
           "--lat-repeats", str(a.rounds), "--out", out]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL if not a.verbose else None)
    with open(out) as f:
        r = json.load(f)
    lat, thr = r["latency"], r["throughput"]
    return {"engine": "llama.cpp " + r["llama_cpp_python"], "load_s": r["load_s"],
            "ttft_ms": round(lat["ttft_s_best"] * 1e3, 1), "ms_per_token": lat["ms_per_out_tok_decode_best"],
            f"batch{a.batch}_out_tok_s": thr.get("out_tok_s_best", thr.get("out_tok_s")),
            "tokens": lat["tokens"], "system_info": r["system_info"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default="/tmp/peers/models/llama1b-q4_k_m.gguf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--in-len", type=int, default=128)
    ap.add_argument("--out-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args()
    sys.path.insert(0, PEERS)
    from workload import make_prompts

    prompts = make_prompts(a.batch, a.in_len, seed=0)
    load = os.getloadavg()[0]
    rows = [run_llama_cpp(a)]
    rows.insert(0, run_vllite(a, prompts))
    ours, theirs = rows[0]["tokens"], rows[1]["tokens"]
    result = {"greedy_tokens_agreeing": next((i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y),
                                             min(len(ours), len(theirs))),
              "gguf": a.gguf, "file_gib": round(os.path.getsize(a.gguf) / 2**30, 2), "threads": a.threads,
              "load_before": round(load, 2), "load_after": round(os.getloadavg()[0], 2), "rows": rows}
    print(json.dumps(result, indent=1))
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
