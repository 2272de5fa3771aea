"""FP8 against bfloat16 KV cache: SmolLM2-135M decode steps at batch 64, 1,024 tokens of context each.

    .venv/bin/python benchmarks/fp8_kv.py [--batch 64 --context 1024 --rounds 5 --kv fp8_e4m3]

Both engines (bfloat16 model; kv_cache_dtype auto = bfloat16, and the fp8 one) are built through
``LLM`` with room for exactly the batch, their caches filled with random values (the time of a step
does not depend on what the cache holds), and one decode step of every request is timed directly on
the engine's model runner: the attention alone (the backend over the 30 layers' caches) and the whole
forward (projections, MLPs, attention, logits). Medians over --rounds, both in one run, printed with
the fp8 / bf16 ratio. The host is shared and noisy: read the ratios, not the absolute times.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402


def _setup(kv: str, a: argparse.Namespace):
    """An engine for the batch, its caches filled, and the two timed callables (attention, whole step)."""
    from vllite_core import LLM
    from vllite_core.attention.reference import build_metadata

    per_req = -(-(a.context + 1) // 16)
    llm = LLM(dtype="bfloat16", max_model_len=a.context + 16, kv_cache_dtype=kv,
              num_kv_blocks=a.batch * per_req + 1, max_num_seqs=a.batch)
    runner = llm.llm_engine.core.engine_core.worker.runner
    model, backend = runner.model, runner.attn_backend
    g = torch.Generator().manual_seed(0)
    for cache in runner.kv_caches:
        cache.copy_(torch.randn(cache.shape, generator=g))
    tables = (torch.randperm(a.batch * per_req, generator=g) + 1).view(a.batch, per_req).tolist()
    md = build_metadata([1] * a.batch, [a.context + 1] * a.batch, tables, 16)
    backend.prepare(md)
    attn = model.model.layers[0].self_attn
    h, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_size
    q = torch.randn(a.batch, h, d, generator=g).to(torch.bfloat16)
    k = torch.randn(a.batch, hkv, d, generator=g).to(torch.bfloat16)
    v = torch.randn(a.batch, hkv, d, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 1000, (a.batch,), generator=g)
    pos = torch.full((a.batch,), a.context, dtype=torch.long)
    layers = len(runner.kv_caches)

    def attention() -> None:
        for cache in runner.kv_caches:
            backend.forward(q, k, v, cache, md, attn.scale)

    def step() -> None:
        model.compute_logits(model(ids, pos, runner.kv_caches, [md] * layers))

    cache_bytes = sum(c.numel() * c.element_size() for c in runner.kv_caches)
    return llm, {"attention": attention, "step": step}, cache_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--kv", default="fp8_e4m3", help="the fp8 kv_cache_dtype to compare with bfloat16")
    a = ap.parse_args()
    engines = {"bf16": _setup("auto", a), a.kv: _setup(a.kv, a)}
    times: dict[tuple[str, str], list[float]] = {}
    with torch.inference_mode():
        for r in range(a.rounds + 1):  # round 0 warms up; the two caches alternate so noise hits both
            for kv, (_, fns, _) in engines.items():
                for name, fn in fns.items():
                    t0 = time.perf_counter()
                    fn()
                    if r:
                        times.setdefault((kv, name), []).append((time.perf_counter() - t0) * 1e3)
    med = {key: statistics.median(v) for key, v in times.items()}
    print(f"batch {a.batch}, context {a.context}, threads {torch.get_num_threads()}, median of {a.rounds} "
          "interleaved rounds")
    for name in ("attention", "step"):
        print(f"{name:10s} bf16 {med['bf16', name]:8.1f} ms   {a.kv} {med[a.kv, name]:8.1f} ms   ratio fp8/bf16 "
              f"{med[a.kv, name] / med['bf16', name]:.2f}")
    sizes = {kv: e[2] / 2**20 for kv, e in engines.items()}
    print(f"cache      bf16 {sizes['bf16']:8.0f} MiB  {a.kv} {sizes[a.kv]:8.0f} MiB")


if __name__ == "__main__":
    main()
