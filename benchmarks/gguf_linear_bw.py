"""The GGUF block linear alone (quantization="gguf", CPU kernel) on the default model's real layer shapes, as
GB/s of blocks read, against a plain read of the same bytes.

    PYTHONPATH=. .venv/bin/python benchmarks/gguf_linear_bw.py [--threads 1,2] [--rows 1] [--rounds 5]

One round is what a decode step reads, in its order (all 30 layers' tensors, then the head: 96 MiB of
blocks, three times the L3 cache), each call timed and summed per shape: qkv 576 -> 960 (q, k, v merged),
o 576 -> 576, gate_up 576 -> 3072 (merged), down 1536 -> 576, and the LM head 576 -> 49152 (the Q8_0 token
embedding, 30 MiB). "read" is ``torch.sum`` of the same bytes as int64 (a plain stream, the bandwidth
floor). Best of ``--rounds``; at one thread in CPU time of the thread (``time.thread_time``: the host is
shared, and a wall clock counts the time other tenants hold the core), at more in wall time. Any commit
whose CpuModelOps has ``gguf_linear`` runs it (compare two by PYTHONPATH).
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _weights():
    from model_registry.gguf_file import GGUFFile
    from model_registry.layers.quantization.gguf import repack
    from model_registry.source import default_model_source

    f = GGUFFile(default_model_source().gguf_file)

    def raw(name):
        info = f.tensors[name]
        return info.ggml_type.name, np.asarray(f.raw(name)).reshape(info.shape[0], -1)

    def merged(*names):
        parts = [raw(n) for n in names]
        return repack(np.concatenate([p[1] for p in parts]), parts[0][0])

    layers = {"qkv": [], "o": [], "gate_up": [], "down": []}
    for i in range(30):
        b = f"blk.{i}."
        layers["qkv"].append(merged(b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"))
        layers["o"].append(repack(*reversed(raw(b + "attn_output.weight"))))
        layers["gate_up"].append(merged(b + "ffn_gate.weight", b + "ffn_up.weight"))
        layers["down"].append(repack(*reversed(raw(b + "ffn_down.weight"))))
    layers["head"] = [repack(*reversed(raw("token_embd.weight")))]
    return layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--dtype", default="float32", help="the input's (bfloat16: a bf16 model's gguf linears)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--grain", type=int, default=None, help="kernels.GGUF_GRAIN_BYTES (where it exists)")
    ap.add_argument("--gemm-min-rows", type=int, default=None, help="kernels.GGUF_GEMM_MIN_ROWS (where it exists)")
    a = ap.parse_args()
    from vllite_platform_cpu.model_ops import CpuModelOps

    ops = CpuModelOps(fused=True, packed_linear=True)
    from vllite_platform_cpu import kernels

    if a.grain is not None:
        kernels.GGUF_GRAIN_BYTES = a.grain
    if a.gemm_min_rows is not None:
        kernels.GGUF_GEMM_MIN_ROWS = a.gemm_min_rows
    layers = _weights()
    print(f"load average {os.getloadavg()[0]:.1f}; {a.rows} input row(s)")
    print(f"{'threads':>7} {'layer':>8} {'MB':>6} {'ms':>7} {'GB/s':>6} {'read GB/s':>9} {'ratio':>5}")
    order = [(name, i) for i in range(30) for name in ("qkv", "o", "gate_up", "down")] + [("head", 0)]
    xs = {name: torch.randn(a.rows, ws[0].shape[1]).to(getattr(torch, a.dtype)) for name, ws in layers.items()}
    flat = {}
    for name, ws in layers.items():
        flat[name] = [(w.blocks if hasattr(w, "blocks") else w.qs).reshape(-1) for w in ws]
        flat[name] = [f[: f.numel() // 8 * 8].view(torch.int64) for f in flat[name]]
    mb = {name: sum(w.nbytes() for w in ws) / 1e6 for name, ws in layers.items()}
    for threads in (int(t) for t in a.threads.split(",")):
        torch.set_num_threads(threads)
        clock = time.thread_time if threads == 1 else time.perf_counter

        def step(fn):
            took = dict.fromkeys(layers, 0.0)
            for name, i in order:
                t0 = clock()
                fn(name, i)
                took[name] += clock() - t0
            return took

        def linear(name, i):
            ops.gguf_linear(xs[name], layers[name][i], None, {})

        def read(name, i):
            flat[name][i].sum()

        best_t, best_r = {}, {}
        with torch.inference_mode():
            for _ in range(a.rounds + 1):
                for best, fn in ((best_t, linear), (best_r, read)):
                    took = step(fn)
                    if sum(took.values()) < sum(best.values() or [float("inf")]):
                        best.clear()
                        best.update(took)
        for name in (*layers, "all"):
            t = sum(best_t.values()) if name == "all" else best_t[name]
            r = sum(best_r.values()) if name == "all" else best_r[name]
            m = sum(mb.values()) if name == "all" else mb[name]
            print(f"{threads:>7} {name:>8} {m:6.1f} {t * 1e3:7.2f} {m / 1e3 / t:6.1f} {m / 1e3 / r:9.1f} {r / t:5.2f}")


if __name__ == "__main__":
    main()
