"""Read and check one PEFT LoRA adapter directory against the base model's layers.

An adapter is ``adapter_config.json`` plus ``adapter_model.safetensors`` as ``peft``'s
``save_pretrained`` writes them. Each targeted projection has ``lora_A`` [r, in] and ``lora_B``
[out, r]; the update of a row is ``x A^T B^T * scaling`` with scaling ``alpha / r`` (``alpha /
sqrt(r)`` under rslora), folded into B here. The base model says which projections exist and where
each lands in its fused layers (``lora_targets()``), so q/k/v land in row slices of ``qkv_proj``.
The adapter's identity for the prefix cache is a digest of both files' bytes: other weights under
the same name never hit KV blocks computed with the old ones.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from vllite_core.lora.errors import LoRAError
from vllite_core.lora.request import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.default)?\.weight$")


@dataclass
class ModuleUpdate:
    """One projection's low-rank update: rows ``out_start:out_end`` of its engine layer get x A^T B^T."""

    out_start: int
    out_end: int
    lora_a: torch.Tensor  # [r, in]
    lora_b: torch.Tensor  # [out_end - out_start, r], scaling folded in


@dataclass
class LoRAAdapter:
    """A loaded, checked adapter (CPU tensors), keyed by engine layer name."""

    name: str
    int_id: int
    path: str
    rank: int
    content_hash: str
    modules: dict[str, list[ModuleUpdate]] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        return sum(u.lora_a.nbytes + u.lora_b.nbytes for ups in self.modules.values() for u in ups)


def load_adapter(req: LoRARequest, targets: dict[str, tuple[str, int, int]], in_features: dict[str, int],
                 max_lora_rank: int) -> LoRAAdapter:
    """Load ``req``'s directory; ``targets`` maps the HF name of each projection the base model has to
    (engine layer, out_start, out_end), ``in_features`` each engine layer's input size."""
    name, path = req.lora_name, req.lora_path
    if not os.path.isdir(path):
        raise LoRAError(name, "lora_path", f"{path!r} is not a directory")
    cfg_path = os.path.join(path, CONFIG_FILE)
    try:
        with open(cfg_path, "rb") as f:
            cfg_bytes = f.read()
        cfg = json.loads(cfg_bytes)
    except FileNotFoundError:
        raise LoRAError(name, CONFIG_FILE, f"missing in {path!r}") from None
    except (OSError, ValueError) as e:
        raise LoRAError(name, CONFIG_FILE, f"cannot be read: {e}") from None
    if not isinstance(cfg, dict):
        raise LoRAError(name, CONFIG_FILE, "is not a JSON object")
    rank, scaling = _check_config(name, cfg, max_lora_rank)
    weights_path = os.path.join(path, WEIGHTS_FILE)
    if not os.path.exists(weights_path):
        if os.path.exists(os.path.join(path, "adapter_model.bin")):
            raise LoRAError(name, WEIGHTS_FILE, "only adapter_model.bin is present: pickled weights are not "
                            "loaded (they can run code); save the adapter with safe_serialization=True")
        raise LoRAError(name, WEIGHTS_FILE, f"missing in {path!r}")
    with open(weights_path, "rb") as f:
        blob = f.read()
    try:
        from safetensors.torch import load as load_safetensors

        tensors = load_safetensors(blob)
    except Exception as e:  # a corrupt file: any parse error
        raise LoRAError(name, WEIGHTS_FILE, f"cannot be parsed: {e}") from None
    digest = hashlib.sha256(cfg_bytes + b"\0" + blob).hexdigest()
    tm = cfg["target_modules"]
    if isinstance(tm, list):
        unknown = [t for t in tm if t not in supported_names(targets)]
        if unknown:
            raise LoRAError(name, "target_modules", f"{unknown[0]!r} is not a projection of the base model this "
                            f"engine can adapt (supported: {', '.join(supported_names(targets))})")
    adapter = LoRAAdapter(name, req.lora_int_id, path, rank, digest)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoRAError(name, WEIGHTS_FILE, f"tensor {key!r} is not a LoRA A/B weight (only linear "
                            "projections are supported: no embeddings, biases or modules_to_save)")
        pairs.setdefault(m["module"], {})[m["ab"]] = t
    for module, ab in sorted(pairs.items()):
        if module not in targets:
            short = module.rsplit(".", 1)[-1]
            raise LoRAError(name, "target_modules", f"{short!r} ({module}) is not a projection of the base model "
                            f"this engine can adapt (supported: {', '.join(supported_names(targets))})")
        if set(ab) != {"A", "B"}:
            raise LoRAError(name, WEIGHTS_FILE, f"{module} has lora_{''.join(ab)} without its pair")
        engine_name, start, end = targets[module]
        a, b = ab["A"], ab["B"]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != r:
            raise LoRAError(name, WEIGHTS_FILE, f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                            "are not a rank-r pair")
        if r > max_lora_rank:
            raise LoRAError(name, "r", f"{module} has rank {r}, more than max_lora_rank={max_lora_rank}")
        if a.shape[1] != in_features[engine_name] or b.shape[0] != end - start:
            raise LoRAError(name, WEIGHTS_FILE, f"{module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do "
                            f"not fit the base model's layer (in {in_features[engine_name]}, out {end - start})")
        s = scaling if r == rank else _scaling(cfg, r)
        adapter.modules.setdefault(engine_name, []).append(
            ModuleUpdate(start, end, a.float().contiguous(), (b.float() * s).contiguous()))
    if not adapter.modules:
        raise LoRAError(name, WEIGHTS_FILE, "holds no LoRA weights")
    for ups in adapter.modules.values():
        ups.sort(key=lambda u: u.out_start)
    return adapter


def supported_names(targets: dict[str, Any]) -> list[str]:
    return sorted({k.rsplit(".", 1)[-1] for k in targets})


def _scaling(cfg: dict, r: int) -> float:
    alpha = float(cfg.get("lora_alpha", 8))
    return alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r


def _check_config(name: str, cfg: dict, max_lora_rank: int) -> tuple[int, float]:
    """Refuse what the engine does not compute (naming the field); (rank, scaling) otherwise."""
    peft_type = cfg.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAError(name, "peft_type", f"{peft_type!r} is not a LoRA adapter")
    r = cfg.get("r")
    if not isinstance(r, int) or r < 1:
        raise LoRAError(name, "r", f"must be a positive integer, got {r!r}")
    if r > max_lora_rank:
        raise LoRAError(name, "r", f"rank {r} is more than max_lora_rank={max_lora_rank}")
    refused = {
        "use_dora": "DoRA adapters are not supported",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D-style weights) is not supported",
        "modules_to_save": "modules_to_save (fully trained extra modules) is not supported",
        "rank_pattern": "per-module ranks (rank_pattern) are not supported",
        "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
        "lora_bias": "LoRA biases are not supported",
    }
    for key, why in refused.items():
        if cfg.get(key):
            raise LoRAError(name, key, why)
    if cfg.get("bias", "none") != "none":
        raise LoRAError(name, "bias", f"{cfg['bias']!r}: only bias='none' is supported")
    tm = cfg.get("target_modules")
    if not isinstance(tm, (list, str)) or not tm:
        raise LoRAError(name, "target_modules", f"must be a non-empty list or pattern, got {tm!r}")
    return r, _scaling(cfg, r)
