"""One linear of a Llama-3.2-1B-shaped model (down_proj: 2048 x 8192, or --shape N K) at batch ``--rows``:
the bf16 weight through the platform's ``ModelOps.linear`` against a pre-quantized ``QuantWeight`` (W4A16
group 128, W8A16, or FP8 block 128) through ``ModelOps.quant_linear``; median milliseconds of ``--iters`` calls.

    python benchmarks/quant_linear.py --rows 1 --threads 2
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from model_registry.layers.quantization.quant_weight import QuantWeight, pack_int4


def _weights(n: int, k: int) -> dict[str, QuantWeight]:
    g = torch.Generator().manual_seed(0)
    groups = k // 128
    scales = torch.rand(n, groups, generator=g) * 0.01
    out = {"w4a16-g128": QuantWeight(pack_int4(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)),
                                     scales, None, 4, 128, n, k, 8),
           "w8a16-g128": QuantWeight(torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8), scales, None,
                                     8, 128, n, k, 128),
           "fp8-block128": QuantWeight(torch.randn(n, k, generator=g).to(torch.float8_e4m3fn), scales, None, 8, 128,
                                       n, k, 0)}
    return out


def _time(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", type=int, nargs=2, default=(2048, 8192), metavar=("N", "K"))
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from vllite_platform_cpu.model_ops import CpuModelOps

    ops = CpuModelOps(fused=True, packed_linear=False, avx2_gemm=True)  # this AVX2 host's bf16 path
    n, k = args.shape
    x = torch.randn(args.rows, k).to(torch.bfloat16)
    w = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
    state: dict = {}
    with torch.inference_mode():
        base = _time(lambda: ops.linear(x, w, None, state), args.iters)
        print(f"bf16 [{n} x {k}] rows {args.rows}: {base:.3f} ms")
        for name, qw in _weights(n, k).items():
            ms = _time(lambda: ops.quant_linear(x, qw, None, {}), args.iters)
            print(f"{name}: {ms:.3f} ms ({base / ms:.2f}x bf16), weight {qw.nbytes() / 2**20:.1f} MiB "
                  f"vs {w.numel() * 2 / 2**20:.1f}")


if __name__ == "__main__":
    main()
