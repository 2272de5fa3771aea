"""Build a model and fill it from a checkpoint (safetensors folder or GGUF file).

The model is constructed directly on the target device with uninitialised
storage, then every parameter is streamed in through ``model.load_weights``
with Hugging Face names; a parameter left unfilled is an error, never silent
garbage.
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from model_registry.layers.fast_path import report_fast_paths
from model_registry.source import ModelSource, open_gguf
from vllite_core.attention.backend import AttentionBackend
from vllite_core.model_ops import current_model_ops

logger = logging.getLogger("vllite.model_registry")

SAFETENSORS_INDEX = "model.safetensors.index.json"


class WeightsNotFoundError(FileNotFoundError):
    """The model folder holds no weights vllite can read."""


def load_model(source: ModelSource, hf_config: Any, model_cls: type, attn_backend: AttentionBackend,
               dtype: torch.dtype, device: torch.device, quantization: str | None = None) -> torch.nn.Module:
    """An engine model of ``model_cls`` with the checkpoint's weights, in ``dtype`` on ``device``; its linear
    layers given the ``quantization`` method's layout (``model_registry.layers.quantization``) when one is set or
    the checkpoint's config.json names one (``quantization_config``: loaded in its own layout)."""
    from model_registry.layers.quantization import prequantized

    device = torch.device(device)
    quantization = prequantized.resolve_quantization(hf_config, quantization)
    with torch.device(device):
        model = model_cls(hf_config, attn_backend, dtype)
    prepared = None
    if quantization in prequantized.PREQUANTIZED:  # the checkpoint's own layout: placeholders before loading
        prepared = prequantized.prepare(model, quantization, hf_config)
    deferred: set[str] = set()  # GGUF projection weights read as blocks only (quantization="gguf")
    if quantization == "gguf" and source.kind == "gguf":
        from model_registry.layers.quantization.gguf import deferrable

        blocks = deferrable(model)

        def defer(name: str, qtype: str) -> bool:
            if blocks(name, qtype):
                deferred.add(name)
                return True
            return False

        weights = _gguf_weights(source, hf_config, defer=defer)
    else:
        weights = checkpoint_weights(source, hf_config, skip=getattr(model, "skips_weight", None))
    loaded = model.load_weights(weights)
    if prepared is not None:  # repacked now: a missing quantized tensor is named by its checkpoint name
        loaded |= prequantized.finish(prepared, quantization)
    missing = sorted(name for name, _ in model.named_parameters(remove_duplicate=False) if name not in loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise ValueError(f"{source.name}: the checkpoint does not provide {len(missing)} parameter(s): {shown}")
    if quantization and prepared is None:
        from model_registry.layers.quantization import quantize_model

        quantize_model(model, quantization, source)
        if deferred:
            from model_registry.layers.quantization.gguf import dense_deferred

            dense = dense_deferred(model, deferred)
            if dense:
                model.load_weights(_gguf_weights(source, hf_config, only=dense))
    model.eval()
    report = report_fast_paths(model)
    if report.paths:
        logger.info("%s", report.describe(current_model_ops().name))
    return model


def checkpoint_weights(source: ModelSource, hf_config: Any, folder: str | None = None,
                       skip: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of the model's checkpoint, or of the HF checkpoint ``folder`` (a weight update);
    ``skip``: names this rank does not hold (another pipeline stage's layers), never read."""
    if folder is not None:
        return iter_hf_weights(folder, skip)
    if source.kind == "gguf":
        return _gguf_weights(source, hf_config)
    return iter_hf_weights(source.path, skip)


def _gguf_weights(source: ModelSource, hf_config: Any, defer: Callable[[str, str], bool] | None = None,
                  only: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    from model_registry.gguf_weights import iter_gguf_weights

    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    return iter_gguf_weights(open_gguf(source), heads, kv_heads, defer=defer, only=only)


def hf_weight_files(folder: str) -> list[Path]:
    """The weight files of an HF folder: sharded or single safetensors, else PyTorch .bin files."""
    root = Path(folder)
    index = root / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [root / f for f in sorted(set(weight_map.values()))]
    files = sorted(root.glob("*.safetensors"))
    if files:
        return files
    bins = sorted(p for p in root.glob("*.bin") if p.name.startswith("pytorch_model"))
    if bins:
        return bins
    raise WeightsNotFoundError(f"{folder}: no *.safetensors (or pytorch_model*.bin) weights found")


def iter_hf_weights(folder: str, skip: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of an HF checkpoint folder, one file at a time; a safetensors tensor
    ``skip`` names (another pipeline stage's) is not read."""
    from safetensors import safe_open

    for path in hf_weight_files(folder):
        if path.suffix == ".safetensors":
            with safe_open(os.fspath(path), framework="pt") as f:
                for name in f.keys():
                    if skip is None or not skip(name):
                        yield name, f.get_tensor(name)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            yield from state.items()
            del state
