"""One prompt's prefill (the time to first token) in a bfloat16 and a float32 engine loaded side by side in one
process, taking turns, wall and CPU time: on a shared host the two dtypes then see the same neighbours.

    .venv/bin/python benchmarks/prefill_side_by_side.py --model /tmp/peers/models/llama1b --rounds 4

Round 0 includes the first step's packing of the weights.
"""
from __future__ import annotations

import argparse
import logging
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/peers/models/llama1b")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()
    logging.disable(logging.WARNING)
    from vllite_core import LLM, SamplingParams
    from vllite_core.benchmarks.datasets import random_token_ids
    from vllite_core.sampling_params import RequestOutputKind

    engines = {dt: LLM(model=a.model, dtype=dt, max_model_len=a.input_len + 16, max_num_seqs=4,
                       enable_prefix_caching=False).llm_engine for dt in ("bfloat16", "float32")}
    prompts = random_token_ids(a.rounds, a.input_len)
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0, output_kind=RequestOutputKind.FINAL_ONLY)
    for rnd in range(a.rounds):
        for dt, engine in engines.items():
            engine.add_request(f"{rnd}", {"prompt_token_ids": prompts[rnd]}, params)
            t, c = time.perf_counter(), time.process_time()
            while engine.has_unfinished_requests():
                engine.step()
            print(f"round {rnd} {dt:9s} wall {time.perf_counter() - t:6.2f} s, CPU {time.process_time() - c:6.2f} s, "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
