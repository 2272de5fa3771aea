"""GFLOP/s of one bf16 GEMM per shape: the CPU platform's own (csrc/gemm.cpp: AMX tiles where the CPU has them, else
vdpbf16ps) against oneDNN's through torch (``F.linear``, and its prepacked ``mkldnn._linear_pointwise``); and the
platform's W8A8 int8 GEMM (csrc/quant.cpp: the rows quantized, int32 sums, scaled back) in GOP/s where built.

    .venv/bin/python benchmarks/gemm_shapes.py [--rows 2048] [--threads 2] [--shapes 16384x2048 2048x8192 ...]

Default shapes: the Llama-3.2-1B layers' (N x K: qkv 3072x2048, o 2048x2048, gate_up 16384x2048, down 2048x8192).
Each GEMM runs once to warm up, then the best of --rounds is printed (one weight and input each, so a prefill-sized
GEMM's operands are where the engine's are: the weight streamed once per row block, the rows in cache).
"""
from __future__ import annotations

import argparse
import time

import torch

LLAMA1B = ["3072x2048", "2048x2048", "16384x2048", "2048x8192"]


def best_seconds(fn, rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shapes", nargs="+", default=LLAMA1B, help="N x K of each weight")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    from vllite_platform_cpu import kernels

    own = kernels.bf16_gemm_available()
    print(f"rows {a.rows}, threads {torch.get_num_threads()}; GFLOP/s")
    int8 = kernels.int8_gemm_available()
    print("| N x K | vllite bf16 GEMM | oneDNN F.linear | oneDNN prepacked | vllite int8 GEMM |")
    print("|---|---|---|---|---|")
    for shape in a.shapes:
        n, k = (int(v) for v in shape.split("x"))
        g = torch.Generator().manual_seed(0)
        w = (torch.randn(n, k, generator=g) * 0.02).bfloat16()
        x = torch.randn(a.rows, k, generator=g).bfloat16()
        flop = 2 * a.rows * n * k
        cells = []
        if own:
            packed = kernels.bf16_gemm_pack(w)
            out = torch.empty(a.rows, n, dtype=torch.bfloat16)
            cells.append(flop / best_seconds(lambda: kernels.bf16_gemm(out, x, packed, None), a.rounds) / 1e9)
        else:
            cells.append(float("nan"))
        cells.append(flop / best_seconds(lambda: torch.nn.functional.linear(x, w), a.rounds) / 1e9)
        prepacked = torch.ops.mkldnn._reorder_linear_weight(w, a.rows)
        cells.append(flop / best_seconds(lambda: torch.ops.mkldnn._linear_pointwise(x, prepacked, None, "none", [], ""),
                                         a.rounds) / 1e9)
        if int8:
            packed8 = kernels.int8_gemm_pack(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g),
                                             torch.rand(n, generator=g) * 0.01)
            out = torch.empty(a.rows, n, dtype=torch.bfloat16)
            cells.append(flop / best_seconds(lambda: kernels.int8_gemm(out, x, packed8, None), a.rounds) / 1e9)
        else:
            cells.append(float("nan"))
        print(f"| {shape} | " + " | ".join(f"{c:,.0f}" for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
