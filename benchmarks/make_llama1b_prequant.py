#!/usr/bin/env python3
"""Pre-quantized versions of the Llama-3.2-1B-shaped checkpoint (``make_llama1b.py``), written by llm-compressor:
the checkpoints ``prequant_decode.py`` times against the bf16 one.

- ``<src>-w4a16``: compressed-tensors ``pack-quantized`` int4, symmetric, group 128 (llm-compressor's ``W4A16``
  scheme, round to nearest: no calibration data);
- ``<src>-fp8-block``: compressed-tensors ``float-quantized`` e4m3 weights with 128x128 block scales and dynamic
  per-token-group fp8 activations (``FP8_BLOCK``, the Qwen3-FP8 / DeepSeek-V3 layout).
The LM head (tied to the embeddings) stays bf16, as llm-compressor's recipes leave it.

Runs in the producer's own venv (llm-compressor is never installed beside vllite):

    /work/venv-llmc/bin/python benchmarks/make_llama1b_prequant.py [--src /tmp/peers/models/llama1b] [--only w4a16]
"""
from __future__ import annotations

import argparse
import os
import shutil

import torch

SCHEMES = {"w4a16": "W4A16", "fp8-block": "FP8_BLOCK"}


def make(src: str, name: str) -> str:
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = f"{src}-{name}"
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=SCHEMES[name], ignore=["lm_head"]))
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out, save_compressed=True)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out) if f.endswith(".safetensors"))
    print(f"{out}: {size / 2**30:.2f} GiB of safetensors")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src", default="/tmp/peers/models/llama1b")
    p.add_argument("--only", choices=sorted(SCHEMES), action="append")
    args = p.parse_args()
    for name in args.only or sorted(SCHEMES):
        make(args.src, name)


if __name__ == "__main__":
    main()
