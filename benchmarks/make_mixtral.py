#!/usr/bin/env python3
"""A small Mixtral-shaped checkpoint with random weights, for racing a mixture of experts against its peers
(compare.py --model mixtral-small): 8 layers, hidden 1,024, 16 query / 4 KV heads of 64, 32 experts of 1,024
(top 2), SmolLM2's 49,152-token vocabulary and tokenizer (from the embedded GGUF, as make_llama1b.py), bf16
safetensors. 0.9 B parameters in all, 0.15 B active per token.

    .venv/bin/python benchmarks/make_mixtral.py [--out /tmp/peers/models/mixtral-small]
"""
from __future__ import annotations

import argparse

from make_llama1b import save_random

OUT = "/tmp/peers/models/mixtral-small"


def mixtral_config():
    from transformers import MixtralConfig

    return MixtralConfig(vocab_size=49152, hidden_size=1024, intermediate_size=1024, num_hidden_layers=8,
                         num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_local_experts=32,
                         num_experts_per_tok=2, max_position_embeddings=4096, rms_norm_eps=1e-5,
                         rope_theta=1e6, tie_word_embeddings=False, sliding_window=None,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2, torch_dtype="bfloat16")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()
    from transformers import MixtralForCausalLM

    save_random(MixtralForCausalLM, mixtral_config(), args.out)


if __name__ == "__main__":
    main()
