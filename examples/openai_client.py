#!/usr/bin/env python3
"""Talk to `vllite serve` with the official `openai` client: a chat answer streamed token by
token, then a completion with logprobs.

    vllite serve                       # in one terminal (prints the URL)
    python examples/openai_client.py   # in another; --base-url / VLLITE_API_KEY if you changed them
"""
from __future__ import annotations

import argparse
import os

import openai


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--api-key", default=os.environ.get("VLLITE_API_KEY", "none"))
    ap.add_argument("--prompt", default="Write one sentence about why the sky is blue.")
    args = ap.parse_args()

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id
    print(f"model: {model}\n")

    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": args.prompt}], max_tokens=96, temperature=0.0,
        stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage:
            print(f"\n[{chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} completion tokens]")

    resp = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4,
                                     temperature=0.0, logprobs=2)
    choice = resp.choices[0]
    print(f"\ncompletion: {choice.text!r}")
    for tok, lp, top in zip(choice.logprobs.tokens, choice.logprobs.token_logprobs, choice.logprobs.top_logprobs):
        alts = ", ".join(f"{t!r}: {v:.2f}" for t, v in top.items())
        print(f"  {tok!r:>12} {lp:7.3f}   top: {alts}")

    # vLLM extensions go in extra_body: priority (with --scheduling-policy priority), top_k, ...
    try:
        client.completions.create(model=model, prompt="hi", temperature=-1.0)
    except openai.BadRequestError as e:
        print(f"\na bad request is a 400 naming the field: param={e.param!r}")


if __name__ == "__main__":
    main()
