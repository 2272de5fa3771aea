"""Offline benchmarks on one in-process engine: throughput (many requests) and latency (one batch).

Both submit token-id prompts with greedy sampling and ``ignore_eos`` (every request
produces exactly its output length, as in vLLM's benchmarks) and step the engine
directly, timing each request's first and last token. The prefix cache is reset
before every measured run, so repeats compute their prompts again.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from vllite_core.benchmarks.datasets import BenchRequest, digest, random_requests
from vllite_core.benchmarks.report import machine_facts, percentiles
from vllite_core.benchmarks.step_profile import StepProfiler

_ids = itertools.count()


@dataclass
class RunResult:
    elapsed: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    first_tokens: list[list[int]] = field(default_factory=list)

    def metrics(self) -> dict[str, Any]:
        el = self.elapsed
        return {
            "elapsed_s": el,
            "requests_per_s": self.num_requests / el,
            "output_tokens_per_s": self.output_tokens / el,
            "total_tokens_per_s": (self.output_tokens + self.prompt_tokens) / el,
            "num_requests": self.num_requests, "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "ttft_s": percentiles(self.ttft), "tpot_s": percentiles(self.tpot), "e2e_s": percentiles(self.e2e),
        }


def build_engine(engine_args: Any) -> Any:
    from vllite_core.engine.llm_engine import LLMEngine

    t0 = time.perf_counter()
    engine = LLMEngine.from_engine_args(engine_args)
    engine.bench_startup_s = time.perf_counter() - t0  # type: ignore[attr-defined]
    return engine


def engine_facts(engine: Any) -> dict[str, Any]:
    core = engine.core.engine_core  # build_engine's engine core runs in this process (InprocClient)
    cfg = engine.config
    # The runner lives in this process with the uni executor only; the others run it in each rank's worker.
    dtype = core.worker.runner.dtype if core.worker is not None else cfg.model_config.dtype
    facts = {
        "architecture": core.model_info.architecture,
        "model": cfg.model_config.model or "(embedded SmolLM2-135M-Instruct)",
        "dtype": str(dtype).replace("torch.", ""),
        "tensor_parallel_size": cfg.parallel_config.tensor_parallel_size,
        "executor": core.executor.backend,
        "platform": core.platform.name,
        "max_num_seqs": cfg.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
        "enable_prefix_caching": cfg.cache_config.enable_prefix_caching,
        "enforce_eager": cfg.enforce_eager,
        "num_kv_blocks": core.model_info.num_kv_blocks,
        "startup_s": getattr(engine, "bench_startup_s", None),
        "speculative_config": vars(cfg.speculative_config).copy() if cfg.speculative_config else None,
    }
    fwd = getattr(core.worker.runner, "model_forward", None) if core.worker is not None else None
    if fwd is not None and hasattr(fwd, "describe"):
        facts["graphs"] = fwd.describe()
    return facts


def vocab_size(engine: Any) -> int:
    return int(getattr(engine, "vocab_size", 0) or engine.model_info.hf_config.vocab_size)


def run_requests(engine: Any, requests: list[BenchRequest], keep_tokens: int = 0) -> RunResult:
    """Submit every request at once, step until all finish; per-request timings."""
    from vllite_core.sampling_params import SamplingParams

    if engine.config.cache_config.enable_prefix_caching:
        engine.core.reset_prefix_cache()
    ids: list[str] = []
    start = time.perf_counter()
    for i, r in enumerate(requests):
        sp = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
        ids.append(engine.add_request(f"bench-{next(_ids)}", r.engine_prompt(), sp))
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    counts: dict[str, int] = dict.fromkeys(ids, 0)
    toks: dict[str, list[int]] = {rid: [] for rid in ids}
    pending = set(ids)
    while pending and engine.has_unfinished_requests():
        outs = engine.step(delta=True)
        now = time.perf_counter()
        for out in outs:
            rid = out.request_id
            if rid not in counts:
                continue
            new = out.outputs[0].token_ids if out.outputs else []
            if new:
                first.setdefault(rid, now)
                counts[rid] += len(new)
                if len(toks[rid]) < keep_tokens:
                    toks[rid].extend(new[:keep_tokens - len(toks[rid])])
            if out.finished:
                last[rid] = now
                pending.discard(rid)
    elapsed = time.perf_counter() - start
    res = RunResult(elapsed, len(requests), sum(r.input_len for r in requests), sum(counts.values()))
    for rid in ids:
        if rid in first:
            res.ttft.append(first[rid] - start)
            end = last.get(rid, first[rid])
            res.e2e.append(end - start)
            if counts[rid] > 1:
                res.tpot.append((end - first[rid]) / (counts[rid] - 1))
    res.first_tokens = [toks[rid] for rid in ids]
    return res


def _warmup(engine: Any, n: int, input_len: int, seed: int) -> float:
    t0 = time.perf_counter()
    reqs = random_requests(max(n, 1), max(min(input_len, 32), 1), 4, seed=seed + 1000, vocab_size=vocab_size(engine))
    run_requests(engine, reqs)
    return time.perf_counter() - t0


def throughput(engine: Any, requests: list[BenchRequest], repeats: int = 1, warmup: bool = True,
               profile: bool = True, keep_tokens: int = 0) -> dict[str, Any]:
    """Offline throughput: all requests at once, ``repeats`` times; the best run is reported."""
    result: dict[str, Any] = {"bench": "throughput", "engine": engine_facts(engine), "machine": machine_facts()}
    n_in = {r.input_len for r in requests}
    n_out = {r.output_len for r in requests}
    result["workload"] = {"num_requests": len(requests),
                          "input_len": n_in.pop() if len(n_in) == 1 else "mixed",
                          "output_len": n_out.pop() if len(n_out) == 1 else "mixed",
                          "digest": digest([r.prompt_token_ids or [] for r in requests])}
    if warmup:
        result["warmup_s"] = _warmup(engine, min(len(requests), engine.config.scheduler_config.max_num_seqs),
                                     max(n_in or {16}), 0)
    prof = StepProfiler().attach(engine) if profile else None
    runs = []
    try:
        for _ in range(max(repeats, 1)):
            if prof is not None:
                prof.reset()
            res = run_requests(engine, requests, keep_tokens)
            m = res.metrics()
            if prof is not None:
                m["step_profile"] = prof.report()
            runs.append((m, res))
    finally:
        if prof is not None:
            prof.detach()
    best_m, best = min(runs, key=lambda mr: mr[0]["elapsed_s"])
    result["runs_elapsed_s"] = [m["elapsed_s"] for m, _ in runs]
    result.update(best_m)
    if keep_tokens:
        result["first_tokens"] = best.first_tokens
    result["machine"]["load_average_after"] = machine_facts()["load_average"]
    sd = engine.get_stats().spec_decoding
    if sd is not None:  # cumulative over warm-up and every run
        result["spec_decode"] = {"num_drafts": sd.num_drafts, "num_draft_tokens": sd.num_draft_tokens,
                                 "num_accepted_tokens": sd.num_accepted_tokens,
                                 "num_accepted_tokens_per_pos": sd.num_accepted_tokens_per_pos,
                                 "acceptance_rate": sd.acceptance_rate,
                                 "mean_acceptance_length": sd.mean_acceptance_length}
    return result


def latency(engine: Any, batch_size: int, input_len: int, output_len: int, iters: int = 3, warmup_iters: int = 1,
            seed: int = 0, profile: bool = True) -> dict[str, Any]:
    """One batch of ``batch_size`` requests, ``iters`` times: e2e latency percentiles, time per output
    token, TTFT (the prefill and first token) and decode time per token."""
    reqs = random_requests(batch_size, input_len, output_len, seed=seed, vocab_size=vocab_size(engine))
    for _ in range(warmup_iters):
        run_requests(engine, reqs)
    prof = StepProfiler().attach(engine) if profile else None
    e2e, ttft, tpot, tput = [], [], [], []
    try:
        for _ in range(max(iters, 1)):
            res = run_requests(engine, reqs)
            e2e.append(res.elapsed)
            ttft.append(percentiles(res.ttft)["mean"])
            tpot.append(percentiles(res.tpot)["mean"] if res.tpot else float("nan"))
            tput.append(res.output_tokens / res.elapsed)
    finally:
        if prof is not None:
            prof.detach()
    out: dict[str, Any] = {
        "batch_size": batch_size, "input_len": input_len, "output_len": output_len, "iters": len(e2e),
        "e2e_s": percentiles(e2e), "e2e_s_runs": e2e,
        "ms_per_output_token": 1e3 * min(e2e) / output_len,  # e2e / output tokens of one request (vLLM's view)
        "ttft_ms": 1e3 * min(ttft),
        "decode_ms_per_token": 1e3 * min(tpot),  # after the first token
        "output_tokens_per_s": max(tput),
    }
    if prof is not None:
        out["step_profile"] = prof.report()
    return out
