"""The model forward alone on one captured decode step: how much of it is kernels, how much the rest.

    PYTHONPATH=<tree>/platforms/cpu:<tree> .venv/bin/python benchmarks/decode_forward.py --threads 1 --quantization gguf

Runs --batch requests of 128 random ids until a step decodes all of them, keeps that step's forward
inputs, then calls the model on them --iters times (after 20 warm-ups): wall and thread-CPU time per
forward. --split also times every C++ kernel call (thread CPU time, so time the thread spends
descheduled on a shared host is not counted) and prints what the forward spends outside them: the
per-layer Python and small torch ops. Compare two trees by alternating runs (PYTHONPATH at each).
--compare-split alternates, in one process and in rounds of a few forwards each, the decoder stack's split by
requests (one share of the requests per thread, csrc/decoder.cpp) with the whole step split kernel by kernel:
the host's noise then falls on both alike.
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

KERNELS = ("gguf_linear_x8", "avx2_gemm", "small_linear", "paged_attention", "paged_attention_store", "rms_norm",
           "add_rms_norm", "silu_and_mul", "rotary", "llama_decoder_layer", "llama_decoder_stack")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--quantization", default=None, help="e.g. gguf, int8")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--split", action="store_true", help="also time each C++ kernel call")
    ap.add_argument("--prompt-len", type=int, default=128, help="context of the decode step (at most 240)")
    ap.add_argument("--compare-split", action="store_true",
                    help="alternate the split by requests (from 1 row a thread) with the whole step")
    a = ap.parse_args()
    logging.disable(logging.WARNING)
    from vllite_core import LLM, SamplingParams
    from vllite_core.benchmarks.datasets import random_token_ids

    kw = {"model": a.model} if a.model else {}
    if a.quantization:
        kw["quantization"] = a.quantization
    llm = LLM(**kw, dtype=a.dtype, num_threads=a.threads, max_model_len=256, max_num_seqs=a.batch,
              enable_prefix_caching=False)
    engine = llm.llm_engine
    runner = engine.core.engine_core.worker.runner
    captured = {}
    inner = runner.model_forward

    def record(*args, **kwargs):
        captured["inputs"] = (args, kwargs)
        return inner(*args, **kwargs)

    runner.model_forward = record
    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0)
    for i, prompt in enumerate(random_token_ids(a.batch, a.prompt_len)):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    # Step until a step is all decode (one row per request): a large batch's prompts take several chunked-prefill
    # steps, and a fixed count of warm-up steps captured a prefill chunk at batch 64.
    for _ in range(64):
        engine.step()
        if captured["inputs"][0][0].shape[0] == a.batch:
            break
    else:
        raise SystemExit(f"no decode step of {a.batch} rows in 64 steps")
    args, kwargs = captured["inputs"]
    model = runner.model

    def run() -> tuple[list[float], list[float]]:
        wall, cpu = [], []
        for _ in range(a.iters):
            c0, t0 = time.thread_time(), time.perf_counter()
            model(*args, **kwargs)
            wall.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
        return wall, cpu

    with torch.inference_mode():
        for _ in range(20):
            model(*args, **kwargs)
        if a.compare_split:
            _compare_split(lambda: model(*args, **kwargs), a)
            return
        wall, cpu = run()
        print(f"forward, batch {a.batch}, {a.threads} thread(s): median {statistics.median(wall) * 1e3:.3f} ms, "
              f"min {min(wall) * 1e3:.3f}; thread CPU median {statistics.median(cpu) * 1e3:.3f} ms")
        if not a.split:
            return
        from vllite_platform_cpu import kernels

        mod, spent = kernels.load(), {}
        for name in KERNELS:
            fn = getattr(mod, name, None)
            if fn is None:
                continue

            def timed(*x, _fn=fn, _name=name):
                c0 = time.thread_time()
                out = _fn(*x)
                spent[_name] = spent.get(_name, 0.0) + time.thread_time() - c0
                return out

            setattr(mod, name, timed)
        for m in model.modules():  # the one-call paths (CpuModelOps.decoder_stack / decoder_layer) made again: timed
            if getattr(m, "_native", None):
                m._native = None
            if getattr(m, "_native_stack", None):
                m._native_stack = None
        _, cpu = run()
        per = {k: v / a.iters * 1e3 for k, v in spent.items()}
        total = statistics.mean(cpu) * 1e3
        print("kernels, ms per forward: " + ", ".join(f"{k} {v:.3f}" for k, v in per.items())
              + f"; forward {total:.3f}, outside the kernels {total - sum(per.values()):.3f} (thread CPU time)")


def _compare_split(forward, a: argparse.Namespace) -> None:
    """Median wall time per forward, split by requests against whole, in --iters / 10 alternating rounds."""
    from vllite_platform_cpu.decoder_layer import NativeDecoderStack

    modes = {"split by requests": 1, "whole step": 0}
    wall: dict[str, list[float]] = {m: [] for m in modes}
    default = NativeDecoderStack.SPLIT_MIN_ROWS_PER_THREAD
    try:
        for _ in range(max(a.iters // 10, 1)):
            for mode, rows in modes.items():
                NativeDecoderStack.SPLIT_MIN_ROWS_PER_THREAD = rows
                forward()  # the first after a switch: not counted
                for _ in range(5):
                    t0 = time.perf_counter()
                    forward()
                    wall[mode].append(time.perf_counter() - t0)
    finally:
        NativeDecoderStack.SPLIT_MIN_ROWS_PER_THREAD = default
    for mode, times in wall.items():
        print(f"forward, batch {a.batch}, {a.threads} thread(s), {mode}: median {statistics.median(times) * 1e3:.3f} "
              f"ms, min {min(times) * 1e3:.3f}")


if __name__ == "__main__":
    main()
