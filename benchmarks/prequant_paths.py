"""One pre-quantized engine's batch-1 decode steps taking turns between its execution paths, in one process:
the one-call C++ decoder stack (csrc/decoder.cpp), the Python layers (the same kernels, called op by op), and for
FP8 checkpoints the Python layers with the activations' fp8 rounding in torch (``fake_quant``) instead of in
``fp8_linear_act``. A loaded host hits every path alike; one engine in memory.

    python benchmarks/prequant_paths.py /tmp/peers/models/llama1b-fp8-block [--threads 2] [--steps 40]
        [--output-json out.json]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40, help="timed steps per path")
    ap.add_argument("--output-json", default=None)
    a = ap.parse_args()
    logging.disable(logging.WARNING)
    from vllite_platform_cpu import model_ops

    from vllite_core import LLM, SamplingParams

    paths = ["one-call C++ stack", "Python layers"]
    llm = LLM(model=a.model, dtype="bfloat16", max_model_len=64 + 3 * a.steps, max_num_seqs=1,
              enable_prefix_caching=False, num_threads=a.threads, kv_cache_memory=64 << 20)
    eng = llm.llm_engine
    lm = eng.core.engine_core.worker.runner.model.model
    params = SamplingParams(max_tokens=4 + len(paths) * (a.steps + 2) + 4, ignore_eos=True, temperature=0)
    eng.add_request("r", {"prompt_token_ids": list(range(1, 17))}, params)
    for _ in range(3):
        eng.step()
    stack, natives = lm._native_stack, [layer._native for layer in lm.layers]
    assert stack, "the model's layers do not take the one-call C++ path"
    act_args = model_ops.fp8_act_args
    fp8 = any(getattr(getattr(layer.self_attn.qkv_proj.quant_method, "weight", None), "is_float", False)
              for layer in lm.layers)
    if fp8:
        paths.append("Python layers, fp8 rounding in torch")

    def use(path: str) -> None:
        on = path == paths[0]
        lm._native_stack = stack if on else False
        for layer, native in zip(lm.layers, natives):
            layer._native = native if on else False
        model_ops.fp8_act_args = (lambda w: None) if "torch" in path else act_args

    load_before = os.getloadavg()
    times: dict[str, list[float]] = {p: [] for p in paths}
    for i in range(len(paths) * (a.steps + 2)):
        path = paths[i % len(paths)]
        use(path)
        t = time.perf_counter()
        eng.step()
        if i >= 2 * len(paths):
            times[path].append((time.perf_counter() - t) * 1e3)
    use(paths[0])
    load_after = os.getloadavg()
    med = {p: statistics.median(v) for p, v in times.items()}
    print(f"{a.model}: threads {a.threads}, OMP_WAIT_POLICY {os.environ.get('OMP_WAIT_POLICY')}, load average "
          f"{load_before[0]:.1f} -> {load_after[0]:.1f}")
    for p in paths:
        print(f"  {p}: {med[p]:.1f} ms/token (median of {len(times[p])}), x {med[p] / med[paths[0]]:.2f} of the first")
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump({"args": vars(a), "host": os.uname().nodename, "cpu_count": os.cpu_count(),
                       "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"), "load_average": [load_before, load_after],
                       "ms_per_token_batch1": med}, f, indent=1)


if __name__ == "__main__":
    main()
