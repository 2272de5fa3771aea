"""Batch-1 decode of pre-quantized checkpoints against their bf16 original: ms per output token, engines taking
turns step by step, and the memory each engine took at start beside its checkpoint files' size.

    python benchmarks/prequant_decode.py [--threads 2] [--steps 32] [--rounds 3] [--output-json out.json]
        [--engine bf16=/tmp/peers/models/llama1b --engine w4a16=/tmp/peers/models/llama1b-w4a16 ...] [--one-at-a-time]

Default engines: the Llama-3.2-1B-shaped checkpoint of ``make_llama1b.py`` in bfloat16 and its llm-compressor
W4A16 (group 128) and FP8 block (128x128) versions (``make_llama1b_prequant.py``), each loaded with no
``quantization`` argument (the checkpoint's ``quantization_config`` picks the method) in a bfloat16 model, all
in this process. Each round adds one request (``--input-len`` random ids, greedy) to every engine, runs their
prefills, then their decode steps in turn (engine A's step 1, B's step 1, ..., A's step 2, ...): the shared host's
load hits every engine alike. With ``--one-at-a-time`` (a host short of memory for all of them) each round
starts the engines one after the other, each alone in memory, and times a request's decode steps after a warm-up
request (engines then take turns round by round, not step by step). Reported: the median decode step per engine
over all rounds (one step = one output token at batch 1) and its ratio to the first engine's, and per engine the
growth of this process's resident memory while it started (weights, 64 MiB of KV cache, the runner's buffers, what
the allocator kept of the load's transient copies; with ``--one-at-a-time`` an engine may reuse memory the one
before it freed) and during its first step (copies packed on first use), the bytes of the tensors its
model holds, and the size of its ``*.safetensors`` files, with the load average before and after.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SRC = "/tmp/peers/models/llama1b"
DEFAULT_ENGINES = (f"bf16={SRC}", f"w4a16={SRC}-w4a16", f"fp8-block={SRC}-fp8-block")
KV_BYTES = 64 << 20


def rss_bytes() -> int:
    """This process's resident set (VmRSS of /proc/self/status)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def held_bytes(model) -> int:
    """Bytes of the distinct storages behind the model's parameters, buffers and pre-quantized weights."""
    storages: dict[int, int] = {}
    for m in model.modules():
        tensors = list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))
        qw = getattr(getattr(m, "quant_method", None), "weight", None)
        if qw is not None and hasattr(qw, "codes"):
            tensors += [t for t in (qw.codes, qw.scales, qw.zeros, qw.perm) if t is not None]
        for t in tensors:
            st = t.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
    return sum(storages.values())


def files_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", action="append", help="name=folder (repeatable); the first is the baseline")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=16)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--one-at-a-time", action="store_true",
                    help="one engine in memory at a time: each round starts each engine in turn, warms it up (its "
                         "first request's prefill and steps), times a second request's steps, and drops it")
    a = ap.parse_args()
    logging.disable(logging.WARNING)
    from vllite_core import LLM, SamplingParams
    from vllite_core.benchmarks.datasets import random_token_ids

    specs = [e.split("=", 1) for e in (a.engine or DEFAULT_ENGINES)]
    engines, memory = {}, {}

    def start(name: str, folder: str):
        gc.collect()
        before, t = rss_bytes(), time.perf_counter()
        llm = LLM(model=folder, dtype="bfloat16", max_model_len=a.input_len + a.steps + 16, max_num_seqs=1,
                  enable_prefix_caching=False, num_threads=a.threads, kv_cache_memory=KV_BYTES)
        gc.collect()
        model = llm.llm_engine.core.engine_core.worker.runner.model
        if name not in memory:
            memory[name] = {"rss_growth_mib": round((rss_bytes() - before) / 2**20, 1),
                            "weights_held_mib": round(held_bytes(model) / 2**20, 1),
                            "files_mib": round(files_bytes(folder) / 2**20, 1), "kv_cache_mib": KV_BYTES >> 20,
                            "start_s": round(time.perf_counter() - t, 1)}
            print(f"{name}: {memory[name]}", flush=True)
        return llm.llm_engine

    prompt = list(random_token_ids(1, a.input_len, 0, 49152)[0])
    params = SamplingParams(max_tokens=a.steps + 1, ignore_eos=True, temperature=0)
    steps: dict[str, list[float]] = {n: [] for n, _ in specs}
    load_before = os.getloadavg()
    if a.one_at_a_time:
        one_at_a_time(a, specs, start, prompt, params, steps, memory)
    else:
        for name, folder in specs:
            engines[name] = start(name, folder)
    for rnd in range(0 if a.one_at_a_time else a.rounds + 1):  # round 0 warms up (packing, first touches)
        for n, eng in engines.items():
            eng.add_request(f"r{rnd}", {"prompt_token_ids": prompt}, params)
            before = rss_bytes()
            eng.step()  # prefill and the first token
            if not rnd:  # what the first step adds (packed copies made on first use)
                memory[n]["rss_growth_first_step_mib"] = round((rss_bytes() - before) / 2**20, 1)
        for _ in range(a.steps):
            for n, eng in engines.items():
                t = time.perf_counter()
                eng.step()
                if rnd:
                    steps[n].append((time.perf_counter() - t) * 1e3)
        for eng in engines.values():
            assert not eng.has_unfinished_requests()
        if rnd:
            print(f"round {rnd}: " + ", ".join(f"{n} {statistics.median(v[-a.steps:]):.1f}" for n, v in steps.items())
                  + " ms/token", flush=True)
    load_after = os.getloadavg()
    base = specs[0][0]
    med = {n: statistics.median(v) for n, v in steps.items()}
    rows = [{"engine": n, "ms_per_token_batch1": round(med[n], 2), "speedup_vs_" + base: round(med[base] / med[n], 2),
             **memory[n]} for n, _ in specs]
    print(f"threads {a.threads}, OMP_WAIT_POLICY {os.environ.get('OMP_WAIT_POLICY')}, {a.rounds} rounds x {a.steps} "
          f"steps each, load average "
          f"{load_before[0]:.1f} -> {load_after[0]:.1f}")
    print(f"| engine | ms/token, batch 1 (median step) | x {base} | RSS growth at start (+ first step), MiB "
          "| weights held, MiB | files, MiB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['engine']} | {r['ms_per_token_batch1']} | {r['speedup_vs_' + base]} | {r['rss_growth_mib']} "
              f"(+{r['rss_growth_first_step_mib']}) | {r['weights_held_mib']} | {r['files_mib']} |")
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump({"args": vars(a), "host": os.uname().nodename, "cpu_count": os.cpu_count(),
                       "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
                       "load_average": [load_before, load_after], "rows": rows}, f, indent=1)


def one_at_a_time(a, specs, start, prompt, params, steps, memory) -> None:
    """Rounds of engine after engine, each alone in memory (a host too small for all of them at once): started, a
    first request run through (packing, first touches; the first step's memory growth kept from round 1), then a
    second request's decode steps timed, then dropped."""
    for rnd in range(1, a.rounds + 1):
        for name, folder in specs:
            eng = start(name, folder)
            for rid in ("warm", "timed"):
                eng.add_request(f"{rid}{rnd}", {"prompt_token_ids": prompt}, params)
                before = rss_bytes()
                eng.step()  # prefill and the first token
                if rid == "warm" and "rss_growth_first_step_mib" not in memory[name]:
                    memory[name]["rss_growth_first_step_mib"] = round((rss_bytes() - before) / 2**20, 1)
                for _ in range(a.steps):
                    t = time.perf_counter()
                    eng.step()
                    if rid == "timed":
                        steps[name].append((time.perf_counter() - t) * 1e3)
                assert not eng.has_unfinished_requests()
            del eng
            gc.collect()
        print(f"round {rnd}: " + ", ".join(f"{n} {statistics.median(v[-a.steps:]):.1f}" for n, v in steps.items())
              + " ms/token", flush=True)


if __name__ == "__main__":
    main()
