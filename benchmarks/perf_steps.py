"""Where a prefill step's and a batched decode step's time goes, down to the C++ kernels' symbols.

    .venv/bin/python benchmarks/perf_steps.py --model /tmp/peers/models/llama1b --dtype bfloat16 --batch 16

The decoder layers run in one C++ call (csrc/decoder.cpp), which torch.profiler sees as one op; so each phase
(the prefill steps of --batch prompts, then --decode-steps decode steps) is timed step by step (wall and
CPU time: on a shared host the CPU time is the comparable one) and, with
--perf, sampled by ``perf record`` (Linux perf on PATH) attached to this process, its top symbols printed. The
process's RSS is printed after start, after the warm-up's first step (the weights' packed copies made) and at
the end. The engine runs in this process (LLM), with the prefix cache off.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def rss_gb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    return 0.0


class Perf:
    """``perf record`` on this process while in the block; its report's top symbols printed after."""

    def __init__(self, on: bool, name: str, top: int) -> None:
        self.on, self.path, self.top = on, f"/tmp/perf_steps_{name}_{os.getpid()}.data", top

    def __enter__(self) -> Perf:
        if self.on:
            self.proc = subprocess.Popen(["perf", "record", "-q", "-e", "cpu-clock", "-F", "499", "-p",
                                          str(os.getpid()), "-o", self.path], stderr=subprocess.DEVNULL)
            time.sleep(0.5)
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.on:
            return
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait()
        rep = subprocess.run(["perf", "report", "-i", self.path, "--no-children", "--sort", "symbol",
                              "--percent-limit", "0.5", "--stdio"], capture_output=True, text=True).stdout
        lines = [ln for ln in rep.splitlines() if ln.strip() and not ln.startswith("#")]
        print("\n".join(lines[:self.top]))
        os.remove(self.path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/peers/models/llama1b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=16, help="prompts (one prefill step of batch x input-len tokens "
                    "while that fits --max-num-batched-tokens)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=4)
    ap.add_argument("--perf", action="store_true")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    logging.disable(logging.WARNING)
    from vllite_core import LLM, SamplingParams
    from vllite_core.benchmarks.datasets import random_token_ids
    from vllite_core.sampling_params import RequestOutputKind

    t0 = time.perf_counter()
    llm = LLM(model=a.model, dtype=a.dtype, max_model_len=a.input_len + a.decode_steps + 16,
              max_num_seqs=a.batch, enable_prefix_caching=False)
    engine = llm.llm_engine
    print(f"loaded in {time.perf_counter() - t0:.1f} s, RSS {rss_gb():.2f} GB")
    prompts = random_token_ids(a.batch, a.input_len)
    budget = engine.config.scheduler_config.max_num_batched_tokens
    prefill_steps = -(-a.batch * a.input_len // budget)
    for rnd in range(2):
        params = SamplingParams(max_tokens=2 if rnd == 0 else a.decode_steps + 1, ignore_eos=True, temperature=0,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        for i, p in enumerate(prompts[:2] if rnd == 0 else prompts):
            engine.add_request(f"{rnd}-{i}", {"prompt_token_ids": p}, params)
        if rnd == 0:  # warm-up: two short prompts, both routes' packed weights made
            t = time.perf_counter()
            engine.step()
            print(f"first step {time.perf_counter() - t:.1f} s, RSS {rss_gb():.2f} GB")
            while engine.has_unfinished_requests():
                engine.step()
            print(f"after warm-up RSS {rss_gb():.2f} GB")
            continue
        with Perf(a.perf, "prefill", a.top):
            for s in range(prefill_steps):
                t, c = time.perf_counter(), time.process_time()
                engine.step()
                print(f"prefill step {s}: {(time.perf_counter() - t) * 1000:.0f} ms "
                      f"({(time.process_time() - c) * 1000:.0f} ms of CPU)")
        with Perf(a.perf, "decode", a.top):
            times, cpu = [], []
            for _ in range(a.decode_steps):
                t, c = time.perf_counter(), time.process_time()
                engine.step()
                times.append((time.perf_counter() - t) * 1000)
                cpu.append((time.process_time() - c) * 1000)
            print("decode steps (ms): " + " ".join(f"{x:.0f}" for x in times) + "; CPU ms: "
                  + " ".join(f"{x:.0f}" for x in cpu))
        while engine.has_unfinished_requests():
            engine.step()
    print(f"end RSS {rss_gb():.2f} GB")


if __name__ == "__main__":
    main()
