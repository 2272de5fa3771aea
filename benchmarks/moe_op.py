"""The CPU fused-MoE op alone, side by side in one process (issue 54's batch-1 speed, below the engine's noise):
the one-call C++ path (``CpuModelOps.moe_one_call``, csrc/moe.cpp), the Python path it replaces on AVX2 hosts
(``moe_grouped``: the experts expert by expert through ``linear``), and the dense SwiGLU MLP of the active size
(``top_k * expert_inter``) on the same kernels, at a few token counts. The three take turns call by call, so the
host's drifting load hits them alike; fastest and median microseconds per call.

Two routings: ``hot`` (every call the same experts: their weights stay in cache, as the dense MLP's do, so the
difference is the op's own overhead) and ``cold`` (fresh random experts each call out of ``--experts``: the
weights come from memory, as in a real decode step of a large MoE).

    python benchmarks/moe_op.py --out benchmarks/results/moe_op_zen3.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def make_ops():
    """The CPU platform's model ops, as the engine gets them."""
    from vllite_core.config import VlliteConfig
    from vllite_core.platforms.resolve import resolve_platform

    return resolve_platform("cpu").platform.model_ops(VlliteConfig())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--expert-inter", type=int, default=512)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--tokens", default="1,2,4,16", help="token counts (comma-separated)")
    ap.add_argument("--calls", type=int, default=300, help="timed calls of each variant per token count and routing")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = make_ops()
    if not hasattr(ops, "moe_one_call"):
        raise SystemExit(f"model ops {ops.name}: not the CPU platform's with its kernels")
    dt = getattr(torch, args.dtype)
    h, i, e, k = args.hidden, args.expert_inter, args.experts, args.top_k
    gen = torch.Generator().manual_seed(0)
    w13 = (torch.randn(e, 2 * i, h, generator=gen) * 0.05).to(dt)
    w2 = (torch.randn(e, h, i, generator=gen) * 0.05).to(dt)
    gate_up = (torch.randn(2 * k * i, h, generator=gen) * 0.05).to(dt)
    down = (torch.randn(h, k * i, generator=gen) * 0.05).to(dt)
    one_state: dict = {}
    grouped_state: dict = {}
    dense_state: tuple[dict, dict] = ({}, {})

    def dense(x, ids, weights):
        return ops.linear(ops.silu_and_mul(ops.linear(x, gate_up, None, dense_state[0])), down, None, dense_state[1])

    variants = {
        "one_call": lambda x, ids, weights: ops.moe_one_call(x, w13, w2, weights, ids, one_state),
        "grouped": lambda x, ids, weights: ops.moe_grouped(x, w13, w2, weights, ids, grouped_state),
        "dense_active": dense,
    }
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[:3]
    rows = []
    with torch.inference_mode():
        # Pack every expert for both expert paths first (untimed): the timed calls measure steady decode.
        all_ids = (torch.arange(e)[:, None] + torch.arange(k)[None]) % e  # every expert, twice
        x = torch.randn(e, h, generator=gen).to(dt)
        weights = torch.full((e, k), 1.0 / k, dtype=dt)
        for fn in variants.values():
            fn(x, all_ids, weights)
        ref = variants["grouped"](x, all_ids, weights).float()
        err = (variants["one_call"](x, all_ids, weights).float() - ref).abs().max().item()
        for t in [int(s) for s in args.tokens.split(",")]:
            for routing in ("hot", "cold"):
                fixed = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
                times: dict[str, list[float]] = {name: [] for name in variants}
                for c in range(args.calls + 10):
                    ids = fixed if routing == "hot" else torch.stack([torch.randperm(e, generator=gen)[:k]
                                                                      for _ in range(t)])
                    x = torch.randn(t, h, generator=gen).to(dt)
                    weights = torch.softmax(torch.randn(t, k, generator=gen), -1).to(dt)
                    names = list(variants)
                    for name in names[c % 3:] + names[: c % 3]:  # a different one first each call
                        t0 = time.perf_counter()
                        variants[name](x, ids, weights)
                        if c >= 10:  # the first calls warm the caches up
                            times[name].append(time.perf_counter() - t0)
                row = {"tokens": t, "routing": routing}
                for name, ts in times.items():
                    row[f"{name}_us_min"] = round(1e6 * min(ts), 1)
                    row[f"{name}_us_median"] = round(1e6 * statistics.median(ts), 1)
                for stat in ("min", "median"):
                    row[f"one_call_over_dense_{stat}"] = round(row[f"one_call_us_{stat}"]
                                                               / row[f"dense_active_us_{stat}"], 2)
                    row[f"grouped_over_dense_{stat}"] = round(row[f"grouped_us_{stat}"]
                                                              / row[f"dense_active_us_{stat}"], 2)
                rows.append(row)
                timing = ", ".join(f"{name} {row[f'{name}_us_min']:.1f} / {row[f'{name}_us_median']:.1f}"
                                   for name in variants)
                print(f"T={t:>3} {routing:>4}: {timing} us (min / median); one call / dense "
                      f"{row['one_call_over_dense_min']}x, grouped / dense {row['grouped_over_dense_min']}x (min)",
                      flush=True)
    with open("/proc/loadavg") as f:
        load_after = f.read().split()[:3]
    if args.out:
        args.out.write_text(json.dumps({**vars(args), "out": str(args.out), "model_ops": ops.name,
                                        "one_call_vs_grouped_max_abs_diff": err, "rows": rows,
                                        "load_average_before_after": [load_before, load_after]}, indent=2) + "\n")


if __name__ == "__main__":
    main()
