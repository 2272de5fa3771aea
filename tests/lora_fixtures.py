"""PEFT adapters for the LoRA tests: made with peft itself (the reference), saved in its format."""
from __future__ import annotations

import copy

import torch

# Three adapters: different ranks, different target sets, one rslora.
ADAPTERS = {
    "qv-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all-r8-rslora": dict(r=8, lora_alpha=16, use_rslora=True,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "mlp-ko-r2": dict(r=2, lora_alpha=4, target_modules=["k_proj", "o_proj", "gate_proj", "down_proj"]),
}


def make_adapter(base, path, seed: int, scale: float = 1.0, **config):
    """A non-trivial random adapter on a copy of ``base`` (peft's init_lora_weights=False), saved to ``path``;
    returns the peft model (the reference)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(init_lora_weights=False, **config))
    if scale != 1.0:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(scale)
    model.save_pretrained(str(path))
    return model.eval()
