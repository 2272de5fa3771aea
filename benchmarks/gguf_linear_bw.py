"""The GGUF block linear alone (quantization="gguf", CPU kernel) on the default model's real layer shapes, as
GB/s of blocks read, against a plain read of the same bytes.

    PYTHONPATH=. .venv/bin/python benchmarks/gguf_linear_bw.py [--threads 1,2] [--rows 1] [--rounds 5]

Every shape is measured over all 30 layers' tensors (76 MiB of Q4_1 blocks, more than the L3 cache), in
layer order as a decode step reads them: qkv 576 -> 960 (q, k, v merged), o 576 -> 576, gate_up 576 -> 3072
(merged), down 1536 -> 576, and the LM head 576 -> 49152 (the Q8_0 token embedding, 30 MiB). "read" is
``torch.sum`` of the same bytes as int64 (a plain stream, the bandwidth floor). Best of ``--rounds``
(the host is shared). Works on any commit whose CpuModelOps has ``gguf_linear`` (compare two by PYTHONPATH).
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _weights():
    from model_registry.gguf_blocks import repack
    from model_registry.gguf_file import GGUFFile
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


def _best(fn, rounds):
    fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    from vllite_platform_cpu.model_ops import CpuModelOps

    ops = CpuModelOps(fused=True, packed_linear=True)
    layers = _weights()
    print(f"load average {os.getloadavg()[0]:.1f}; {a.rows} input row(s)")
    print(f"{'threads':>7} {'layer':>8} {'MB':>6} {'ms':>7} {'GB/s':>6} {'read GB/s':>9} {'ratio':>5}")
    for threads in (int(t) for t in a.threads.split(",")):
        torch.set_num_threads(threads)
        tot_ms = tot_read = tot_mb = 0.0
        for name, ws in layers.items():
            k = ws[0].shape[1]
            xs = [torch.randn(a.rows, k) for _ in ws]
            mb = sum(w.nbytes() for w in ws) / 1e6
            flat = [(w.blocks if hasattr(w, "blocks") else w.qs).reshape(-1) for w in ws]
            flat = [f[: f.numel() // 8 * 8].view(torch.int64) for f in flat]

            def run():
                with torch.inference_mode():
                    for w, x in zip(ws, xs):
                        ops.gguf_linear(x, w, None, {})

            def read():
                for f in flat:
                    f.sum()

            t, r = _best(run, a.rounds), _best(read, a.rounds)
            tot_ms, tot_read, tot_mb = tot_ms + t * 1e3, tot_read + r * 1e3, tot_mb + mb
            print(f"{threads:>7} {name:>8} {mb:6.1f} {t * 1e3:7.2f} {mb / 1e3 / t:6.1f} {mb / 1e3 / r:9.1f} "
                  f"{r / t:5.2f}")
        print(f"{threads:>7} {'all':>8} {tot_mb:6.1f} {tot_ms:7.2f} {tot_mb / tot_ms:6.1f} {tot_mb / tot_read:9.1f} "
              f"{tot_read / tot_ms:5.2f}")


if __name__ == "__main__":
    main()
