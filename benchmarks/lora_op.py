"""The multi-LoRA op alone: one decode step's LoRA work at SmolLM2-135M's layer shapes.

Per step: 30 layers x (qkv 576->960 rank 3x16, o 576->576 rank 16, gate_up 576->3072 rank 2x16,
down 1536->576 rank 16), ``--batch`` rows spread over ``--slots`` adapters (round-robin, as a mixed
decode batch is). Variants take turns, best of ``--rounds``: the per-slot loop the op used to be
(index_select, two matmuls, index_add per slot), the torch default of ``ModelOps.lora_add`` (one gather,
two matmuls per segment, one scatter-add), and the CPU platform's C++ kernel when it is built. Also
the base product of the same layers (``F.linear``), to put the LoRA time in proportion. Timed in
this process's CPU seconds (``time.process_time``, all threads; run with OMP_WAIT_POLICY=PASSIVE), which
other tenants of a shared machine barely inflate; ``--threads 1`` compares the kernels' own speed.

    python benchmarks/lora_op.py [--batch 64] [--slots 4] [--rank 16] [--rounds 5] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
import torch.nn.functional as F

from vllite_core.lora.mapping import build_mapping
from vllite_core.model_ops import ModelOps

LAYERS = [(576, 960, 3), (576, 576, 1), (576, 3072, 2), (1536, 576, 1)]  # (in, out, projections fused)


def per_slot_loop(y, x, a, b, ranks, m):
    """The op before the mapping: a gather, two matmuls and a scatter-add per active slot."""
    for slot, start, end in m.segments:
        idx = m.order[start:end]
        r = ranks[slot]
        y.index_add_(0, idx, F.linear(x.index_select(0, idx), a[slot, :r]) @ b[slot, :r])
    return y


@torch.inference_mode()  # as the engine runs (the CPU kernels leave autograd's cases to torch)
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--num-layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(0)
    # The base weights first, then every adapter tensor, as an engine allocates them (model, then slots).
    shapes = [(d_in, d_out, fused * a.rank) for _ in range(a.num_layers) for d_in, d_out, fused in LAYERS]
    base = [(torch.randn(a.batch, d_in, generator=gen), torch.randn(d_out, d_in, generator=gen) * 0.02)
            for d_in, d_out, _ in shapes]
    adapters = [(torch.randn(a.slots, cap, d_in, generator=gen) * 0.02,
                 torch.randn(a.slots, cap, d_out, generator=gen) * 0.02, [cap] * a.slots,
                 torch.zeros(a.batch, d_out))  # the base output the update is added to
                for d_in, d_out, cap in shapes]
    layers = [b + ad for b, ad in zip(base, adapters)]
    m = build_mapping(np.arange(a.batch) % a.slots, a.slots, "cpu")
    variants = {"base_linear": lambda x, w, la, lb, r, y: F.linear(x, w),
                "per_slot_loop": lambda x, w, la, lb, r, y: per_slot_loop(y, x, la, lb, r, m),
                "torch_default": lambda x, w, la, lb, r, y: ModelOps().lora_add(y, x, la, lb, r, m)}
    try:
        from vllite_platform_cpu import kernels
        from vllite_platform_cpu.model_ops import CpuModelOps

        if kernels.available():
            ops = CpuModelOps(fused=True, packed_linear=False)
            variants["cpu_kernel"] = lambda x, w, la, lb, r, y: ops.lora_add(y, x, la, lb, r, m)
    except ImportError:
        pass
    ref = None
    for name, fn in variants.items():  # the LoRA variants agree
        if name != "base_linear":
            out = fn(*layers[0][:-1], torch.zeros_like(layers[0][-1]))
            ref = out if ref is None else ref
            assert torch.allclose(out, ref, atol=1e-4), name
    best = {k: float("inf") for k in variants}
    for _ in range(a.rounds):
        for name, fn in variants.items():
            t0 = time.process_time()
            for layer in layers:
                fn(*layer)
            best[name] = min(best[name], time.process_time() - t0)
    print(json.dumps({"batch": a.batch, "slots": a.slots, "rank": a.rank, "layers": len(layers),
                      "threads": a.threads, "cpu_ms_per_step": {k: round(v * 1e3, 2) for k, v in best.items()},
                      "over_base_linear": {k: round(v / best["base_linear"], 3) for k, v in best.items()}}, indent=2))


if __name__ == "__main__":
    main()
