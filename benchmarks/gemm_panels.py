"""The AVX2 GEMM on float32 against bfloat16 panels of one weight, the Llama-3.2-1B layers' shapes, in CPU time.

    VLLITE_CPU_ISA=avx2 .venv/bin/python benchmarks/gemm_panels.py --rows 16 32 128 2048

On a shared host wall time measures the neighbours; each call's CPU time (process_time, all threads) is what this
prints, best of --rounds, the two panel types taking turns. Run it from two trees (PYTHONPATH) to compare builds.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 32, 128, 2048])
    ap.add_argument("--layers", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    a = ap.parse_args()
    from vllite_platform_cpu import kernels

    torch.set_num_threads(a.threads)
    print(f"kernels from {kernels.load().__file__}, {a.threads} threads")
    for name in a.layers:
        n, k = SHAPES[name]
        w = torch.randn(n, k)
        packs = {"float32": kernels.avx2_gemm_pack(w), "bfloat16": kernels.avx2_gemm_pack(w.bfloat16())}
        for rows in a.rows:
            x, out = torch.randn(rows, k), torch.empty(rows, n)
            best = dict.fromkeys(packs, float("inf"))
            for _ in range(a.rounds):
                for dt, p in packs.items():
                    t = time.process_time()
                    kernels.avx2_gemm(out, x, p, None)
                    best[dt] = min(best[dt], time.process_time() - t)
            gf = {dt: 2 * rows * n * k / s / 1e9 for dt, s in best.items()}
            print(f"{name:8s} {rows:5d} rows: float32 {best['float32'] * 1e3:8.1f} ms ({gf['float32']:5.1f} GFLOP/s "
                  f"of CPU), bfloat16 {best['bfloat16'] * 1e3:8.1f} ms ({gf['bfloat16']:5.1f}); bf16/f32 time "
                  f"{best['bfloat16'] / best['float32']:.2f}", flush=True)


if __name__ == "__main__":
    main()
