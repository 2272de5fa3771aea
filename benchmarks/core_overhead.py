#!/usr/bin/env python3
"""Per-step overhead outside the model, this checkout against another (``--baseline-tree``), in one run.

A tiny random Llama (hidden 64, 2 layers: the model's share is small, so the engine's own work shows)
serves BATCH greedy requests of IN prompt tokens and OUT output tokens, in process, through
``LLMEngine.step()``. Per decode step it reports:

- ``outside_us``: the step's CPU time on the calling thread less that of the executor's
  ``execute_model`` (the model), i.e. scheduling, updating requests, output processing and
  detokenizing (CPU time of this thread, not wall time: other jobs on a shared host do not count);
- ``stats_us``: one read of the core's numbers as AsyncLLM takes it after every engine-loop turn;
- ``wire_us``: encoding and decoding one engine-core output message (BATCH outputs and the stats)
  as the engine-core process and its client do every step.

Each tree runs in its own process (PYTHONPATH set to it), taking turns for ``--rounds`` rounds so that
a shared machine's drift hits both alike; the best round of each is kept and the ratio printed.

    .venv/bin/python benchmarks/core_overhead.py --baseline-tree /work/main
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _tree_env(tree: str) -> dict[str, str]:
    paths = [tree, *(os.path.join(tree, p) for p in ("platforms/cpu", "platforms/triton_common", "plugins/bart"))]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _timed_model(engine) -> list[float]:
    """Wrap the executor's ``execute_model`` (the model's share of a step) with a CPU-time counter."""
    core = engine.core.engine_core if hasattr(engine.core, "engine_core") else engine.core
    spent = [0.0]
    real = core.executor.execute_model

    def timed(*args, **kw):
        t0 = time.thread_time()
        try:
            return real(*args, **kw)
        finally:
            spent[0] += time.thread_time() - t0

    core.executor.execute_model = timed
    return spent


def _stats_read(engine):
    """One read of the core's numbers as AsyncLLM's engine loop takes it after each turn, in either tree."""
    from vllite_core.engine import async_llm

    if not hasattr(async_llm, "EngineSnapshot"):  # this tree: the one record
        return engine.core.stats
    holder = type("Loop", (), {})()  # the tree before: scheduler stats, then the KV numbers, copied
    holder.engine = engine
    return lambda: async_llm.AsyncLLM._take_snapshot(holder)


def _wire_message(outputs, stats):
    from vllite_core.engine import core_messages

    if hasattr(core_messages, "EngineCoreStats"):  # before the one stats record: the scheduler's numbers copied
        s = stats
        stats = core_messages.EngineCoreStats(s.num_running, s.num_waiting, s.kv_cache_usage, 100, 200,
                                              s.num_preemptions_total, s.prefix_cache_queries, s.prefix_cache_hits,
                                              10, 10, 0.1, 0.2, 0.3, None, s.num_jump_forward_tokens, None)
    return core_messages.EngineCoreOutputs(0, outputs, stats, True, 1)


def child(model: str, batch: int, input_len: int, output_len: int, reps: int) -> None:
    """Runs in the tree under test: one JSON line of per-step numbers."""
    import logging

    import numpy as np

    logging.disable(logging.WARNING)
    from vllite_core import SamplingParams
    from vllite_core.config import EngineArgs
    from vllite_core.engine.core_messages import EngineMessage
    from vllite_core.engine.llm_engine import LLMEngine
    from vllite_core.engine.serial_utils import MsgpackDecoder, MsgpackEncoder

    engine = LLMEngine.from_engine_args(EngineArgs.from_kwargs(
        model=model, dtype="float32", num_kv_blocks=batch * (-(-(input_len + output_len) // 16) + 1) + 8,
        max_model_len=input_len + output_len + 16, max_num_seqs=batch, max_num_batched_tokens=batch * input_len,
        enable_prefix_caching=False))
    model_s = _timed_model(engine)
    read_stats = _stats_read(engine)
    rng = np.random.RandomState(0)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    best = None
    for _ in range(reps):
        for i in range(batch):
            engine.add_request(f"r{i}", {"prompt_token_ids": rng.randint(17, 500, input_len).tolist()}, params)
        engine.step()  # the prefill
        outside, steps = 0.0, 0
        while engine.has_unfinished_requests():
            before = model_s[0]
            t0 = time.thread_time()
            engine.step()
            outside += time.thread_time() - t0 - (model_s[0] - before)
            steps += 1
        run = outside / steps
        best = run if best is None else min(best, run)
    n = 2000
    t0 = time.thread_time()
    for _ in range(n):
        read_stats()
    stats_s = (time.thread_time() - t0) / n
    # One step's message as the engine-core process sends it: BATCH outputs of one token each.
    from vllite_core.engine.core import EngineCoreOutput

    outputs = [EngineCoreOutput(f"r{i}", [100 + i], num_cached_tokens=0, first_scheduled_time=1.0)
               for i in range(batch)]
    core = engine.core.engine_core if hasattr(engine.core, "engine_core") else engine.core
    msg = _wire_message(outputs, core.stats())
    enc, dec = MsgpackEncoder(), MsgpackDecoder(EngineMessage)
    t0 = time.thread_time()
    for _ in range(n):
        dec.decode(enc.encode(msg))
    wire_s = (time.thread_time() - t0) / n
    print(json.dumps({"outside_us": best * 1e6, "stats_us": stats_s * 1e6, "wire_us": wire_s * 1e6}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline-tree", required=True, help="the other vllite checkout (its platforms/cpu built)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=2, help="workload passes per round (the best is kept)")
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        model, *nums = args.child
        child(model, *map(int, nums))
        return
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    sys.path.insert(0, ROOT)
    from tiny_models import TINY, save_tiny
    from transformers import LlamaConfig

    trees = {"this": ROOT, "base": os.path.abspath(args.baseline_tree)}
    results: dict[str, list[dict]] = {k: [] for k in trees}
    with tempfile.TemporaryDirectory() as model:
        save_tiny(model, LlamaConfig(**TINY, architectures=["LlamaForCausalLM"]))
        for r in range(args.rounds):
            for name, tree in trees.items():
                cmd = [sys.executable, os.path.join(HERE, "core_overhead.py"), "--baseline-tree", tree, "--child",
                       model, str(args.batch), str(args.input_len), str(args.output_len), str(args.reps)]
                out = subprocess.run(cmd, env=_tree_env(tree), cwd=tree, capture_output=True, text=True)
                if out.returncode != 0:
                    raise SystemExit(f"{name} ({tree}) failed:\n{out.stderr[-3000:]}")
                results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(f"round {r} {name}: {results[name][-1]}", flush=True)
    print(f"\nbatch {args.batch}, {args.input_len} in, {args.output_len} out; best of {args.rounds} rounds")
    print(f"{'per step':<12}{'this':>12}{'base':>12}{'this/base':>12}")
    for key in ("outside_us", "stats_us", "wire_us"):
        this = min(x[key] for x in results["this"])
        base = min(x[key] for x in results["base"])
        print(f"{key:<12}{this:>12.1f}{base:>12.1f}{this / base:>12.3f}")


if __name__ == "__main__":
    main()
