"""The paged-attention kernel on one SmolLM2-135M decode step, caches streamed from memory.

    .venv/bin/python benchmarks/attention_decode.py --batch 64 --context 192
    .venv/bin/python benchmarks/attention_decode.py --batch 8 --context 4096 --layers 16 --heads 32 --kv-heads 8 \
        --dtype bfloat16    # the Llama-3.2-1B shape's long workload

30 layers, each with its own float32 (or --dtype) KV cache, so every step reads the whole context
from DRAM as the engine does: 9 query heads, 3 KV heads of 64, blocks of 16 tokens placed at
random (``--same-blocks``: every request reads the same blocks, so the cache sits in L2 and only the
compute is timed). The caches sit on transparent huge pages as the CPU platform's do (``--small-pages``: 4 KiB
pages, where every block costs a TLB miss). Prints the median and best ms per step over --rounds and the K/V bytes
per second.
Checks the kernel against a float64 softmax once, on the first layer.
"""
from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=192)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--heads", type=int, default=9, help="query heads (Llama-3.2-1B: 32)")
    ap.add_argument("--kv-heads", type=int, default=3, help="KV heads (Llama-3.2-1B: 8)")
    ap.add_argument("--same-blocks", action="store_true",
                    help="every request reads the same blocks: the cache stays in L2, only compute is timed")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--small-pages", action="store_true",
                    help="caches on 4 KiB pages (default: on transparent huge pages where the OS has them, as the "
                         "CPU platform allocates its KV cache)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    from vllite_platform_cpu import kernels

    dt = getattr(torch, a.dtype)
    B, L, H, HKV, D, BS = a.batch, a.context, a.heads, a.kv_heads, 64, 16
    g = torch.Generator().manual_seed(0)
    per_req = -(-L // BS)
    nblocks = B * per_req + 1
    tables = torch.randperm(nblocks - 1, generator=g).view(B, per_req).to(torch.int32)
    if a.same_blocks:
        tables = tables[:1].repeat(B, 1).contiguous()

    def cache() -> torch.Tensor:
        t = torch.randn(nblocks, BS, HKV, D, generator=g).to(dt)
        if a.small_pages:
            return t
        from vllite_platform_cpu.attention import zeroed_huge_pages
        return zeroed_huge_pages(t.numel() * t.element_size()).view(dt).view(t.shape).copy_(t)

    caches = [(cache(), cache()) for _ in range(a.layers)]
    q = torch.randn(B, H, D, generator=g).to(dt)
    out = torch.empty_like(q)
    seq = torch.full((B,), L, dtype=torch.int32)
    qsl = torch.arange(B + 1, dtype=torch.int32)
    rid = torch.arange(B, dtype=torch.int32)
    scale = D ** -0.5
    kc, vc = caches[0]
    kernels.paged_attention(out, q, kc, vc, tables, seq, qsl, rid, scale)
    k = kc[tables.long()].flatten(1, 2)[:, :L].double()  # [B, L, HKV, D]
    v = vc[tables.long()].flatten(1, 2)[:, :L].double()
    kq = k.repeat_interleave(H // HKV, dim=2)
    vq = v.repeat_interleave(H // HKV, dim=2)
    p = torch.softmax(torch.einsum("bhd,blhd->bhl", q.double(), kq) * scale, dim=-1)
    ref = torch.einsum("bhl,blhd->bhd", p, vq)
    err = (out.double() - ref).abs().max().item()
    times = []
    for _ in range(a.rounds):
        t0 = time.perf_counter()
        for kc, vc in caches:
            kernels.paged_attention(out, q, kc, vc, tables, seq, qsl, rid, scale)
        times.append(time.perf_counter() - t0)
    times.sort()
    nbytes = 2 * B * L * HKV * D * kc.element_size() * a.layers
    print(f"threads {torch.get_num_threads()}, batch {B}, context {L}, {a.layers} layers, {a.dtype}, "
          f"K/V {nbytes / 1e6:.0f} MB per step, max error vs float64 {err:.1e}")
    print(f"median {times[len(times) // 2] * 1e3:.1f} ms (best {times[0] * 1e3:.1f}), "
          f"{nbytes / times[len(times) // 2] / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
