"""One linear of a Llama-3.2-1B-shaped model (down_proj: 2048 x 8192, or --shape N K) at batch ``--rows``:
the bf16 weight through the platform's ``ModelOps.linear`` against a pre-quantized ``QuantWeight`` (W4A16
group 128, W8A16, or FP8 block 128) through ``ModelOps.quant_linear``, and GGUF blocks (Q4_0, Q4_K, Q5_K, Q6_K:
random blocks, ``--gguf``) through ``ModelOps.gguf_linear``; median milliseconds of ``--iters`` calls.
``--only w4a16`` times only the formats whose name holds that text, beside the bf16 and float32 dense weights and
with float32 activations too (W4A16: the float kernel; bf16 activations take the int4 x int8 one), all in turns.

    python benchmarks/quant_linear.py --rows 1 --threads 2 [--gguf-only] [--only w4a16]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from model_registry.layers.quantization.gguf import GGUFWeight, repack
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


def _gguf_weights(n: int, k: int) -> dict[str, GGUFWeight]:
    """Random GGUF blocks (every byte random but the fp16 scales) repacked as a GGUF checkpoint's are at load."""
    rng = np.random.default_rng(0)
    out = {}
    for qtype, nbytes, scale_at in (("Q4_0", 18, (0,)), ("Q4_K", 144, (0, 2)), ("Q5_K", 176, (0, 2)),
                                    ("Q6_K", 210, (208,))):
        per = 32 if qtype == "Q4_0" else 256
        raw = rng.integers(0, 256, (n, k // per, nbytes), dtype=np.uint8)
        for at in scale_at:
            raw[:, :, at:at + 2] = (rng.random((n, k // per, 1)) * 1e-3).astype(np.float16).view(np.uint8)
        out[f"gguf-{qtype}"] = repack(raw.reshape(n, -1), qtype)
    return out


def _time(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _interleaved(fns: dict, iters: int) -> dict[str, float]:
    """Median ms of each function, timed in turns (one call of each per round): on a shared, noisy host the load
    of the moment weighs on all of them alike, so their ratios hold better than those of one-after-the-other runs."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for name, fn in fns.items():
        fn()
    for _ in range(iters):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", type=int, nargs=2, default=(2048, 8192), metavar=("N", "K"))
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--gguf-only", action="store_true", help="bf16 and the GGUF types only")
    ap.add_argument("--only", default=None, help="the formats whose name holds this text (and float32 baselines)")
    ap.add_argument("--copies", type=int, default=1,
                    help="GGUF: calls rotate over this many copies of the blocks (8: past a 32 MB L3, as a model's "
                         "layers are; 1: the same blocks every call, cache-resident when they fit)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from vllite_platform_cpu.model_ops import CpuModelOps

    ops = CpuModelOps(fused=True, packed_linear=False, avx2_gemm=True)  # this AVX2 host's bf16 path
    n, k = args.shape
    x = torch.randn(args.rows, k).to(torch.bfloat16)
    w = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
    x32, w32 = x.float(), w.float()
    state32: dict = {}
    state: dict = {}
    with torch.inference_mode():
        base = _time(lambda: ops.linear(x, w, None, state), args.iters)
        print(f"bf16 [{n} x {k}] rows {args.rows}: {base:.3f} ms")
        if args.only is not None:
            fns = {"bf16": lambda: ops.linear(x, w, None, state), "fp32": lambda: ops.linear(x32, w32, None, state32)}
            for name, qw in _weights(n, k).items():
                if args.only in name:
                    fns[f"{name} (fp32 activations)"] = lambda qw=qw: ops.quant_linear(x32, qw, None, {})
                    fns[name] = lambda qw=qw: ops.quant_linear(x, qw, None, {})
            ms = _interleaved(fns, args.iters)
            for name, t in ms.items():
                print(f"  {name}: {t:.3f} ms ({ms['bf16'] / t:.2f}x bf16)")
            return
        for name, gw in _gguf_weights(n, k).items():
            if args.only is not None and args.only not in name:
                continue
            copies = [gw] + [GGUFWeight(gw.qtype, gw.blocks.clone(), gw.rows) for _ in range(args.copies - 1)]
            turn = iter(range(1 << 30))
            ms = _time(lambda: ops.gguf_linear(x, copies[next(turn) % len(copies)], None, {}), args.iters)
            print(f"{name}: {ms:.3f} ms ({base / ms:.2f}x bf16), weight {gw.nbytes() / 2**20:.1f} MiB "
                  f"vs {w.numel() * 2 / 2**20:.1f}")
        if args.gguf_only:
            return
        for name, qw in _weights(n, k).items():
            if args.only is not None and args.only not in name:
                continue
            ms = _time(lambda: ops.quant_linear(x, qw, None, {}), args.iters)
            print(f"{name}: {ms:.3f} ms ({base / ms:.2f}x bf16), weight {qw.nbytes() / 2**20:.1f} MiB "
                  f"vs {w.numel() * 2 / 2**20:.1f}")


if __name__ == "__main__":
    main()
