"""The linear layers of one SmolLM2-135M decode step, timed per CPU GEMM path, weights streamed from memory.

    .venv/bin/python benchmarks/linear_layers.py --rows 1 5 64
    .venv/bin/python benchmarks/linear_layers.py --shape llama1b --layers 4 --rows 1 32 256

30 layers of (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536) plus the 49152x576 LM head,
float32, each weight its own tensor (540 MB in all, so every step reads them from DRAM as the engine
does). The paths run in turns, one step each, and the median and best of --rounds are printed:
``onednn`` (torch's mkldnn packed linear), ``avx2`` (the CPU platform's AVX2 GEMM, where built),
``small`` (the weight-streaming kernel, up to 4 rows); and the same layers in bfloat16 (270 MB):
``avx2-bf16`` (the AVX2 GEMM's 16-bit panels, widened in registers), ``small-bf16``, and where the CPU has
native bf16 math ``onednn-bf16`` (oneDNN's packed bf16 kernel); where built (AVX512-BF16) ``bf16-gemm``
(the platform's own bf16 GEMM, csrc/gemm.cpp, on vdpbf16ps) and where the CPU has AMX ``bf16-amx`` (the same
GEMM on AMX tiles, csrc/amx.cpp); and W8A8 (``quantization="int8"``, bf16 rows in and out):
where the CPU has VNNI ``int8-mm`` (quantize, ``torch._int_mm``, dequantize: the path before the int8 GEMM)
and where built (AVX512-VNNI) ``int8-gemm`` (csrc/quant.cpp, all three in one call; ``int8-amx``: the same on
AMX tiles); without VNNI ``int8-panels`` (the same W8A8 numbers on the AVX2 GEMM's bfloat16 panels).
``--shape llama1b``: the Llama-3.2-1B shape's layers instead (qkv 3072x2048, o 2048x2048, gate_up
16384x2048, down 2048x8192, LM head 49152x2048); ``--layers`` takes fewer layers than the model has (the
weights still far exceed the caches, so the bytes per second are the model's), and ``mkl`` is F.linear on
the plain float32 weight (torch's default GEMM).
``--paths`` keeps only the named paths; each cell also gives the weights' bytes read per second (GB/s).
"""
from __future__ import annotations

import argparse
import time

import torch

# Per model shape: one decoder layer's (N, K) linears, its layer count, and the LM head's (N, K).
SHAPES = {"smollm2": ([(960, 576), (576, 576), (3072, 576), (576, 1536)], 30, (49152, 576)),
          "llama1b": ([(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)], 16, (49152, 2048))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 5, 64])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's)")
    ap.add_argument("--paths", nargs="+", default=None, help="only these paths (e.g. avx2 avx2-bf16)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    from vllite_platform_cpu import kernels

    g = torch.Generator().manual_seed(0)
    layer, n_layers, head = SHAPES[a.shape]
    weights = [torch.randn(n, k, generator=g) * 0.05 for _ in range(a.layers or n_layers) for n, k in layer]
    weights.append(torch.randn(*head, generator=g) * 0.05)
    flops_per_row = sum(2 * w.numel() for w in weights)
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    avx2 = [kernels.avx2_gemm_pack(w) for w in weights] if kernels.avx2_gemm_available() else None
    weights16 = [w.bfloat16() for w in weights]
    avx2_16 = [kernels.avx2_gemm_pack(w) for w in weights16] if torch.bfloat16 in kernels.avx2_gemm_dtypes() else None
    # oneDNN's packed bf16 kernel: the engine's bf16 path on CPUs with native bf16 math (AVX512-BF16, AMX)
    onednn16 = ([torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights16]
                if torch.ops.mkldnn._is_mkldnn_bf16_supported() else None)
    ours16 = [kernels.bf16_gemm_pack(w) for w in weights16] if kernels.bf16_gemm_available() else None
    from vllite_core.model_ops import quantize_rows_int8

    int8 = [quantize_rows_int8(w) for w in weights]
    int8_packed = [kernels.int8_gemm_pack(q, s) for q, s in int8] if kernels.int8_gemm_available() else None
    amx = kernels.amx_available()
    print(f"threads {torch.get_num_threads()}, weights {sum(w.numel() for w in weights) * 4 / 1e6:.0f} MB")
    for m in a.rows:
        xs = {k: torch.randn(m, k, generator=g) for k in {w.shape[1] for w in weights}}
        outs = {n: torch.empty(m, n) for n in {w.shape[0] for w in weights}}
        paths = {"onednn": lambda: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                                    for w, p in zip(weights, onednn)],
                 "mkl": lambda: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in weights]}
        if avx2 is not None:
            paths["avx2"] = lambda: [kernels.avx2_gemm(outs[w.shape[0]], xs[w.shape[1]], p, None)
                                     for w, p in zip(weights, avx2)]
        if m <= 4:
            paths["small"] = lambda: [kernels.small_linear(outs[w.shape[0]], xs[w.shape[1]], w, None) for w in weights]
        if avx2_16 is not None:
            paths["avx2-bf16"] = lambda: [kernels.avx2_gemm(outs[w.shape[0]], xs[w.shape[1]], p, None)
                                          for w, p in zip(weights16, avx2_16)]
        if onednn16 is not None:
            xs16 = {k: x.bfloat16() for k, x in xs.items()}
            paths["onednn-bf16"] = lambda: [torch.ops.mkldnn._linear_pointwise(xs16[w.shape[1]], p, None, "none", [],
                                                                              "")
                                            for w, p in zip(weights16, onednn16)]
        if ours16 is not None:
            xs16b = {k: x.bfloat16() for k, x in xs.items()}
            outs16 = {n: torch.empty(m, n, dtype=torch.bfloat16) for n in outs}

            def bf16_gemm(amx: bool) -> None:
                kernels.set_amx(amx)
                for w, p in zip(weights16, ours16):
                    kernels.bf16_gemm(outs16[w.shape[0]], xs16b[w.shape[1]], p, None)

            paths["bf16-gemm"] = lambda: bf16_gemm(False)
            if amx:
                paths["bf16-amx"] = lambda: bf16_gemm(True)
        if m <= 4:
            paths["small-bf16"] = lambda: [kernels.small_linear(outs[w.shape[0]], xs[w.shape[1]], w, None)
                                           for w in weights16]
        xs8 = {k: x.bfloat16() for k, x in xs.items()}
        outs8 = {n: torch.empty(m, n, dtype=torch.bfloat16) for n in outs}

        def int8_mm() -> None:
            for (q, scale) in int8:
                x = xs8[q.shape[1]]
                xq, xsc = torch.empty(x.shape, dtype=torch.int8), torch.empty(m)
                kernels.quantize_rows_int8(xq, xsc, x)
                kernels.dequantize_int32(outs8[q.shape[0]], torch._int_mm(xq, q.t()), xsc, scale, None)

        if m > 16:  # _int_mm needs more than 16 rows
            paths["int8-mm"] = int8_mm
        if avx2_16 is not None and int8_packed is None:  # no VNNI: W8A8 on the AVX2 GEMM's bf16 panels
            from vllite_platform_cpu.model_ops import CpuModelOps

            panel_ops = CpuModelOps(fused=True, packed_linear=False, avx2_gemm=True, int8_panels=True)
            panel_states: list[dict] = [{} for _ in int8]

            def int8_panels() -> None:
                with torch.no_grad():
                    for (q, scale), st in zip(int8, panel_states):
                        panel_ops.int8_linear(xs8[q.shape[1]], q, scale, None, st)

            paths["int8-panels"] = int8_panels
        if int8_packed is not None:

            def int8_gemm(amx: bool) -> None:
                kernels.set_amx(amx)
                for (q, _), p in zip(int8, int8_packed):
                    kernels.int8_gemm(outs8[q.shape[0]], xs8[q.shape[1]], p, None)

            paths["int8-gemm"] = lambda: int8_gemm(False)
            if amx:
                paths["int8-amx"] = lambda: int8_gemm(True)
        if a.paths:
            paths = {name: run for name, run in paths.items() if name in a.paths}
        times: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(a.rounds + 1):  # the first round warms up
            for name, run in paths.items():
                t0 = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - t0)
        cells = []
        for name, ts in times.items():
            ts = sorted(ts[1:])
            med = ts[len(ts) // 2]
            gflops = flops_per_row * m / med / 1e9
            # 1, 2 or 4 bytes per weight (int8-panels reads bf16 panels)
            per_weight = 1 if name == "int8-panels" else 0.5 if "int8" in name else 1 if "bf16" in name else 2
            gbs = flops_per_row * per_weight / med / 1e9
            cells.append(f"{name} {med * 1e3:6.1f} ms (best {ts[0] * 1e3:.1f}, {gflops:.0f} GFLOPS, {gbs:.1f} GB/s)")
        print(f"rows {m:4d}: " + "   ".join(cells), flush=True)


if __name__ == "__main__":
    main()
