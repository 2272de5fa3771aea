"""Multi-LoRA overhead: batch-64 throughput with 4 rank-16 adapters mixed, against the base model alone.

One process, one run: an engine without LoRA and an engine with ``enable_lora`` take turns on
the same 64 prompts (greedy, ``ignore_eos``); the LoRA engine's batch has 16 requests for each of
4 random adapters (all seven projections, rank 16, PEFT's file format). Best of ``--rounds`` per
engine; the ratio is what to read (the machine is shared and noisy). Beside wall time, the process's
CPU seconds (all threads; run with OMP_WAIT_POLICY=PASSIVE so idle threads sleep): other tenants of
a shared machine stretch wall time but barely the CPU time the work itself takes. Also the first
request with a new adapter (load from disk, checks, slot copy) against the same request once it is
resident.

    python benchmarks/lora.py [--model PATH] [--batch 64] [--input-len 32] [--output-len 32]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
from safetensors.torch import save_file

from vllite_core import LLM, LoRARequest, SamplingParams


def write_adapter(path: str, model, rank: int, seed: int) -> None:
    """A random adapter over every projection, as peft's save_pretrained lays it out."""
    gen = torch.Generator().manual_seed(seed)
    modules = dict(model.named_modules())
    tensors = {}
    for hf_name, (engine_name, start, end) in model.lora_targets().items():
        in_f = modules[engine_name].weight.shape[1]
        tensors[f"base_model.model.{hf_name}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) / in_f ** 0.5
        tensors[f"base_model.model.{hf_name}.lora_B.weight"] = torch.randn(end - start, rank, generator=gen) * 0.01
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    targets = sorted({k.rsplit(".", 1)[-1] for k in model.lora_targets()})
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets,
                   "bias": "none", "use_rslora": False, "fan_in_fan_out": False}, f)


def timed(llm: LLM, prompts, sp, loras) -> tuple[float, int, float]:
    """(wall seconds, tokens, this process's CPU seconds: all its threads, what other tenants cannot inflate)."""
    c0, t0 = time.process_time(), time.perf_counter()
    outs = llm.generate(prompts, sp, lora_request=loras)
    return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs), time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--num-adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    common = dict(model=a.model, dtype=a.dtype, max_model_len=512, enable_prefix_caching=False)
    base = LLM(**common)
    lora = LLM(**common, enable_lora=True, max_loras=a.num_adapters, max_lora_rank=a.rank)
    gen = torch.Generator().manual_seed(0)
    vocab = base.llm_engine.vocab_size
    prompts = [{"prompt_token_ids": torch.randint(10, vocab, (a.input_len,), generator=gen).tolist()}
               for _ in range(a.batch)]
    sp = SamplingParams(temperature=0.0, max_tokens=a.output_len, ignore_eos=True)
    tmp = tempfile.mkdtemp(prefix="vllite-lora-bench-")
    model = lora.llm_engine.core.engine_core.worker.runner.model
    reqs = []
    for i in range(a.num_adapters + 1):
        write_adapter(os.path.join(tmp, f"a{i}"), model, a.rank, seed=i)
        reqs.append(LoRARequest(f"a{i}", i + 1, os.path.join(tmp, f"a{i}")))
    # First request with a new adapter vs the same once resident (1 output token).
    one = SamplingParams(temperature=0.0, max_tokens=1)
    cold = timed(lora, prompts[:1], one, reqs[-1])[0]
    warm = timed(lora, prompts[:1], one, reqs[-1])[0]
    disk_load = lora.llm_engine.lora_registry.load_times[reqs[-1].lora_name]
    mixed_loras = [reqs[i % a.num_adapters] for i in range(a.batch)]
    timed(base, prompts[:4], sp, None)  # warm-up both
    timed(lora, prompts[:4], sp, mixed_loras[:4])
    runs = {"base": (base, None), "lora_engine_base_only": (lora, None), "mixed": (lora, mixed_loras)}
    best = {k: float("inf") for k in runs}
    best_cpu = {k: float("inf") for k in runs}
    tokens = 0
    for _ in range(a.rounds):
        for name, (llm, loras) in runs.items():
            t, tokens, cpu = timed(llm, prompts, sp, loras)
            best[name] = min(best[name], t)
            best_cpu[name] = min(best_cpu[name], cpu)
    tput = {k: tokens / v for k, v in best.items()}
    report = {
        "model": a.model or "SmolLM2-135M-Instruct (embedded)", "dtype": str(model.dtype), "batch": a.batch,
        "input_len": a.input_len, "output_len": a.output_len, "adapters": a.num_adapters, "rank": a.rank,
        "tokens_per_s": {k: round(v, 1) for k, v in tput.items()},
        "mixed_over_base": round(tput["mixed"] / tput["base"], 3),
        "overhead_pct": round(100 * (1 - tput["mixed"] / tput["base"]), 1),
        "lora_engine_base_only_over_base": round(tput["lora_engine_base_only"] / tput["base"], 3),
        "mixed_over_lora_engine_base_only": round(tput["mixed"] / tput["lora_engine_base_only"], 3),
        "cpu_s": {k: round(v, 2) for k, v in best_cpu.items()},
        "cpu_overhead_pct": round(100 * (best_cpu["mixed"] / best_cpu["base"] - 1), 1),
        "first_request_new_adapter_s": round(cold, 4), "same_request_adapter_resident_s": round(warm, 4),
        "adapter_disk_load_and_check_s": round(disk_load, 4),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
