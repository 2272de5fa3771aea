"""Tiny random-weight checkpoints built from transformers configs, saved with a real tokenizer."""
from __future__ import annotations

import torch

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)


def save_tiny(path, config, seed=0, tokenizer=None):
    """Random weights (scaled so greedy choices are not near-ties) + ``tokenizer`` (default: SmolLM2's), into
    ``path``."""
    from transformers import AutoModelForCausalLM

    from model_registry.source import load_tokenizer, resolve_model_source

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(path)
    (tokenizer or load_tokenizer(resolve_model_source(None))).save_pretrained(path)
    return model.eval()
