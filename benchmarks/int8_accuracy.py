"""Accuracy of ``quantization="int8"`` (W8A8, dynamic activations) against the unquantized model.

    .venv/bin/python benchmarks/int8_accuracy.py [--dtype float32] [--prompts 16] [--tokens 64]

Both engines run greedy on the same chat prompts; reported: per prompt, how many tokens agree before the
first divergence, and over each shared prefix the mean and largest absolute difference between the two
engines' logprobs of the chosen tokens (the quantized engine's cost, in the unquantized dtype's terms).
"""
from __future__ import annotations

import argparse
import json
import logging
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in two sentences.",
    "List three prime numbers.", "How do I reverse a list in Python?", "What is 17 times 23?",
    "Describe a cat to someone who has never seen one.", "Give me a tip for learning a new language.",
    "Why is the sky blue?", "Translate 'good morning' into Spanish.", "What does a compiler do?",
    "Name a famous painting and its painter.", "Summarise the plot of Romeo and Juliet.",
    "What is the boiling point of water in Fahrenheit?", "Suggest a name for a pet goldfish.",
    "How many legs does a spider have?",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--output-json", default=None)
    a = ap.parse_args()
    logging.disable(logging.WARNING)
    from vllite_core import LLM, SamplingParams

    kw = {"model": a.model} if a.model else {}
    msgs = [[{"role": "user", "content": p}] for p in PROMPTS[:a.prompts]]
    sp = SamplingParams(temperature=0, max_tokens=a.tokens, ignore_eos=True, logprobs=0)
    runs = {}
    for q in (None, "int8"):
        llm = LLM(**kw, dtype=a.dtype, quantization=q, max_model_len=512)
        runs[q] = [o.outputs[0] for o in llm.chat(msgs, sp)]
        del llm
    agree, diffs = [], []
    for base, quant in zip(runs[None], runs["int8"]):
        n = next((i for i, (x, y) in enumerate(zip(base.token_ids, quant.token_ids)) if x != y), len(base.token_ids))
        agree.append(n)
        for i in range(n):
            t = base.token_ids[i]
            diffs.append(abs(base.logprobs[i][t].logprob - quant.logprobs[i][t].logprob))
    result = {"dtype": a.dtype, "prompts": len(msgs), "tokens": a.tokens, "agree_before_divergence": agree,
              "agreeing_tokens": sum(agree), "of": len(msgs) * a.tokens,
              "identical_prompts": sum(n == a.tokens for n in agree),
              "mean_abs_logprob_diff": sum(diffs) / max(len(diffs), 1), "max_abs_logprob_diff": max(diffs, default=0.0)}
    print(json.dumps(result, indent=1))
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
