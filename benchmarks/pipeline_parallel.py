"""Pipeline parallelism on this machine: does the batch queue overlap the stages? One engine with
pipeline_parallel_size=2 (mp executor, two worker processes) on a random 8-layer Llama (hidden 512, fp32,
~29 M parameters: big enough that a step is compute, small enough for a 2-core host), the same workload
run with 1 batch in flight (the stages take turns) and with 2 (vLLM V1's batch queue: stage 0 runs batch
B while stage 1 runs batch A), alternated twice, in one run.

    .venv/bin/python benchmarks/pipeline_parallel.py [--requests 16 --prompt-len 64 --output-len 48]

The depth is the engine core's ``batch_queue_size`` (pipeline_parallel_size by default), set to 1 for the
baseline. Each stage's worker gets one thread (the CPU platform divides the host's cores among its ranks),
so with 2 free cores the ideal ratio is 2x less the bubble; other jobs on a shared host take cores from the
stages and the ratio drops towards 1. Whatever the load, the overlap itself is measured: each worker's
model forward passes are timed (wall clock, one host), and ``both_stages_computing`` is the share of the run
during which stage 0 and stage 1 were inside a forward pass at once (0 with one batch in flight). Tokens of
the two depths are checked equal.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _checkpoint(path: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from model_registry.source import load_tokenizer, resolve_model_source

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512)
    LlamaForCausalLM(config).save_pretrained(path)
    load_tokenizer(resolve_model_source(None)).save_pretrained(path)


def _time_forwards(worker) -> None:  # noqa: ANN001 - run on each worker (collective_rpc)
    import time

    model, spans = worker.runner.model, []
    inner = model.forward

    def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        t0 = time.time()
        out = inner(*args, **kwargs)
        spans.append((t0, time.time()))
        return out

    model.forward = timed
    worker.forward_spans = spans


def _take_spans(worker) -> list[tuple[float, float]]:  # noqa: ANN001
    spans = list(worker.forward_spans)
    worker.forward_spans.clear()
    return spans


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)


def main() -> None:
    import numpy as np

    from vllite_core import LLM, SamplingParams

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    a = p.parse_args()
    rs = np.random.RandomState(0)
    prompts = [{"prompt_token_ids": rs.randint(17, 8192, size=a.prompt_len).tolist()} for _ in range(a.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=a.output_len, ignore_eos=True)
    with tempfile.TemporaryDirectory() as path:
        _checkpoint(path)
        llm = LLM(path, dtype="float32", pipeline_parallel_size=2, max_model_len=a.prompt_len + a.output_len + 16,
                  max_num_batched_tokens=a.max_num_batched_tokens, enable_prefix_caching=False)
    core = llm.llm_engine.core.engine_core
    try:
        llm.collective_rpc(_time_forwards)
        llm.generate(prompts[:4], params)  # warm-up
        runs: dict[int, list[float]] = {1: [], 2: []}
        overlap: dict[int, list[float]] = {1: [], 2: []}
        busy: dict[int, list[list[float]]] = {1: [], 2: []}
        tokens = {}
        for depth in (1, 2, 1, 2):
            core.batch_queue_size, core.max_batches_in_flight = depth, 0
            llm.collective_rpc(_take_spans)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            wall = time.perf_counter() - t0
            runs[depth].append(a.requests * a.output_len / wall)
            stage0, stage1 = llm.collective_rpc(_take_spans)
            overlap[depth].append(round(_overlap(stage0, stage1) / wall, 2))
            busy[depth].append([round(sum(e - s for s, e in st) / wall, 2) for st in (stage0, stage1)])
            assert depth == 1 or core.max_batches_in_flight == depth
            tokens[depth] = [o.outputs[0].token_ids for o in outs]
    finally:
        core.shutdown()
    best = {d: max(v) for d, v in runs.items()}
    print(json.dumps({"cpus": len(os.sched_getaffinity(0)), "load_avg_1m": os.getloadavg()[0], "workload": vars(a),
                      "output_tok_per_s": {f"depth {d}": [round(x, 1) for x in v] for d, v in runs.items()},
                      "stage_busy_share": {f"depth {d}": v for d, v in busy.items()},
                      "both_stages_computing": {f"depth {d}": v for d, v in overlap.items()},
                      "tokens_identical": tokens[1] == tokens[2],
                      "depth2_over_depth1_throughput": round(best[2] / best[1], 2)}, indent=2))


if __name__ == "__main__":
    main()
