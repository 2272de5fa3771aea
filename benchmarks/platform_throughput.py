"""Short throughput benchmark of one platform: offline generation and paged-attention kernel time.

    python benchmarks/platform_throughput.py --device cuda --out results/throughput.json

A random-weight model with SmolLM2-135M's shape (no download) generates
``--num-prompts`` requests of ``--input-len`` random tokens, ``--output-len``
greedy tokens each (EOS ignored), as vLLM's offline throughput benchmark does,
then one request alone (ms per output token); eagerly and through the platform's
captured decode graphs (``--modes``), so the two can be compared.
Then each attention backend the platform offers is timed on one decode batch.
Prints and writes JSON; never asserts speeds.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

SMOLLM2_135M_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                          rms_norm_eps=1e-5, tie_word_embeddings=True)


def save_model(path: str) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from vllite_core.conformance.kit import make_tokenizer, randomize_

    config = LlamaConfig(**SMOLLM2_135M_SHAPE, architectures=["LlamaForCausalLM"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, seed=0)
    model.save_pretrained(path)
    make_tokenizer(config.vocab_size).save_pretrained(path)


def offline(path: str, device: str, dtype: str, n: int, input_len: int, output_len: int, enforce_eager: bool,
            kv_cache_gib: float) -> dict:
    """Throughput on ``n`` requests, then one request alone: ms per output token after the first (the
    difference of a 1-token and a ``1 + output_len``-token run of the same, prefix-cached prompt; best of 3)."""
    from vllite_core import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=path, device=device, dtype=dtype, enforce_eager=enforce_eager,
              max_model_len=input_len + output_len + 16, kv_cache_memory=int(kv_cache_gib * 2**30))
    startup = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(0, 49000, (input_len,), generator=gen).tolist()} for _ in range(n)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)

    def one_request(max_tokens: int) -> float:
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                         use_tqdm=False)
            best = min(best, time.perf_counter() - t)
        return best

    first = one_request(1)
    ms_per_token = (one_request(1 + output_len) - first) / output_len * 1e3
    result = {"requests": n, "input_len": input_len, "output_len": output_len, "dtype": dtype,
              "enforce_eager": enforce_eager, "startup_s": round(startup, 2), "elapsed_s": round(elapsed, 3),
              "requests_per_s": round(n / elapsed, 3), "output_tokens_per_s": round(out_tokens / elapsed, 1),
              "total_tokens_per_s": round((out_tokens + n * input_len) / elapsed, 1),
              "one_request_ms_per_token": round(ms_per_token, 3), "one_request_first_token_ms": round(first * 1e3, 2),
              "attention_backend": llm.llm_engine.core.engine_core.worker.runner.attn_backend.name,
              "graphs": llm.llm_engine.core.engine_core.worker.runner.model_forward.describe()}
    return result


def attention_kernels(device_name: str, batch: int = 32, context: int = 1024, iters: int = 20) -> list[dict]:
    """One decode step of paged attention (Llama-3-8B head shape) per backend the platform can build."""
    from vllite_core.attention.reference import build_metadata
    from vllite_core.attention.sdpa import SdpaPagedAttention
    from vllite_core.config import VlliteConfig
    from vllite_core.platforms import resolve_platform

    platform = resolve_platform(device_name).platform
    device = platform.device()
    heads, kv_heads, head_size, block = 32, 8, 128, 16
    nb = context // block
    tables = [list(range(1 + i * nb, 1 + (i + 1) * nb)) for i in range(batch)]
    md = build_metadata([1] * batch, [context] * batch, tables, block, device=device)
    dtype = torch.bfloat16 if torch.bfloat16 in platform.supported_dtypes() else torch.float32
    q = torch.randn(batch, heads, head_size, device=device, dtype=dtype)
    k = torch.randn(batch, kv_heads, head_size, device=device, dtype=dtype)
    cache = torch.randn(2, batch * nb + 1, block, kv_heads, head_size, device=device, dtype=dtype)
    backends = [platform.get_attention_backend(VlliteConfig())]
    if not isinstance(backends[0], SdpaPagedAttention):
        backends.append(SdpaPagedAttention())
    results = []
    for backend in backends:
        backend.prepare(md)
        for _ in range(3):
            backend.forward(q, k, k, cache, md, head_size ** -0.5)
        platform.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            backend.forward(q, k, k, cache, md, head_size ** -0.5)
        platform.synchronize()
        per = (time.perf_counter() - t0) / iters
        kv_bytes = 2 * batch * context * kv_heads * head_size * cache.element_size()
        results.append({"backend": backend.name, "batch": batch, "context": context, "dtype": str(dtype),
                        "ms_per_step": round(per * 1e3, 3), "kv_read_GBps": round(kv_bytes / per / 1e9, 1)})
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--modes", default="eager,graphs", choices=["eager,graphs", "eager", "graphs"],
                    help="run the model eagerly (enforce_eager), through captured decode graphs, or both")
    ap.add_argument("--kv-cache-gib", type=float, default=4.0)
    ap.add_argument("--attn-batch", type=int, default=32)
    ap.add_argument("--attn-context", type=int, default=1024)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results: dict = {"device": args.device}
    with tempfile.TemporaryDirectory() as path:
        save_model(path)
        results["offline"] = [offline(path, args.device, args.dtype, args.num_prompts, args.input_len,
                                      args.output_len, enforce_eager=mode == "eager", kv_cache_gib=args.kv_cache_gib)
                              for mode in args.modes.split(",")]
    if len(results["offline"]) == 2:
        eager, graphs = results["offline"]
        results["graphs_over_eager"] = {
            "throughput": round(graphs["output_tokens_per_s"] / eager["output_tokens_per_s"], 2),
            "one_request_ms_per_token": round(graphs["one_request_ms_per_token"]
                                              / eager["one_request_ms_per_token"], 2)}
    results["attention"] = attention_kernels(args.device, args.attn_batch, args.attn_context)
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
