"""Wall time of the benchmark workload's engine steps, unprofiled: prefill against decode, and where a decode
step goes (model forward, LM head, the sampler's argmax, the rest of the step).

    .venv/bin/python benchmarks/step_times.py --model /tmp/peers/models/smollm2-135m --dtype bfloat16
    VLLITE_INT8_LM_HEAD=1 .venv/bin/python benchmarks/step_times.py ... --quantization int8

Rounds of the whole workload (64 x (128 in, 128 out), greedy) through ``engine.step()``; a step taken while
some request still has prompt tokens to compute counts as prefill. The split wraps the model's ``forward`` and
``compute_logits`` and the sampler's argmax with timers (a few microseconds each), so unlike profile_steps.py
(cProfile) the step times are what compare.py's runs see.
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    logging.disable(logging.WARNING)
    from vllite_core import LLM, SamplingParams
    from vllite_core.benchmarks.datasets import random_token_ids

    kw = {"model": a.model} if a.model else {}
    llm = LLM(**kw, dtype=a.dtype, quantization=a.quantization, max_model_len=a.input_len + a.output_len + 16,
              max_num_seqs=a.batch, enable_prefix_caching=False)
    engine = llm.llm_engine
    runner = engine.core.engine_core.worker.runner
    spent: dict[str, float] = {"model": 0.0, "lm_head": 0.0, "argmax": 0.0}

    def timed(obj: object, name: str, key: str) -> None:
        fn = getattr(obj, name)

        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - t
        setattr(obj, name, wrapper)

    timed(runner.model, "forward", "model")
    timed(runner.model, "compute_logits", "lm_head")
    timed(runner.sampler, "argmax", "argmax")
    prompts = random_token_ids(a.batch, a.input_len)
    from vllite_core.sampling_params import RequestOutputKind

    # FINAL_ONLY, as LLM.generate (compare.py) sets it: no output object per step
    params = SamplingParams(max_tokens=a.output_len, ignore_eos=True, temperature=0,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    for rnd in range(a.rounds):
        for i, p in enumerate(prompts):
            engine.add_request(f"{rnd}-{i}", {"prompt_token_ids": p}, params)
        prefill: list[float] = []
        decode: list[float] = []
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            target = prefill if _prefilling(engine) else decode
            if target is decode and not decode:  # the split counts decode steps only
                spent.update(dict.fromkeys(spent, 0.0))
            t = time.perf_counter()
            engine.step()
            target.append(time.perf_counter() - t)
        total = time.perf_counter() - start
        n = max(len(decode), 1)
        split = " ".join(f"{k} {v / n * 1e3:.2f}" for k, v in spent.items())
        print(f"round {rnd}: {total:.2f} s; prefill {sum(prefill):.2f} s in {len(prefill)} steps; decode "
              f"{sum(decode):.2f} s in {len(decode)} steps (median {statistics.median(decode or [0]) * 1e3:.1f} ms; "
              f"ms per step: {split}, the rest {(sum(decode) - sum(spent.values())) / n * 1e3:.2f})", flush=True)


def _prefilling(engine: object) -> bool:
    """Whether some running request still has prompt tokens to compute."""
    sched = engine.core.engine_core.scheduler  # type: ignore[attr-defined]
    return bool(len(sched.waiting)) or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running)


if __name__ == "__main__":
    main()
