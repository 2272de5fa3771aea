"""Pre-quantized checkpoints: which method a checkpoint asks for, and giving a model's layers its layout.

``quantization_config.quant_method`` in config.json names the method, as vLLM reads it: ``compressed-tensors``
(``compressed_tensors.py``), ``fp8`` (``fp8.py``), ``gptq`` (``gptq.py``), ``awq`` (``awq.py``). The engine's
``quantization`` may name the same method or be left out; another name is a ConfigError, as is a method asked
for with a checkpoint that was not quantized so.

``prepare`` runs before the weights stream in (each quantized linear layer gets its format's placeholders,
``prequant.PrequantLinearMethod``, which repacks the layer once its last tensor has arrived), ``finish`` after
(a layer still waiting for a tensor is an error naming it). A layer is matched by its checkpoint
names: a fused layer (``qkv_proj``, ``gate_up_proj``) by its shards' names, which must share one scheme.
"""
from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

from model_registry.layers.linear import LinearBase
from model_registry.layers.params import STACKED_PROJECTIONS
from model_registry.layers.quantization.prequant import LayerFormat, PrequantLinearMethod
from model_registry.layers.vocab import ParallelLMHead
from vllite_core.errors import ConfigError

logger = logging.getLogger("vllite.quantization")

PREQUANTIZED = ("compressed-tensors", "fp8", "gptq", "awq")  # quant_method names of config.json
# Formats a model's own loader reads (gpt-oss's MXFP4 experts are dequantised at load in models/gpt_oss.py):
# no linear-layer method is installed for them.
MODEL_READ = ("mxfp4",)


class PrequantConfig(Protocol):
    name: str

    def layer_format(self, hf_name: str) -> LayerFormat | None:
        """The format of the checkpoint layer ``hf_name`` (None: left in float)."""
        ...


def checkpoint_quantization(hf_config: Any) -> dict[str, Any] | None:
    """config.json's ``quantization_config`` (a dict), or None."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    return qc


def resolve_quantization(hf_config: Any, requested: str | None) -> str | None:
    """The method to load with: the checkpoint's ``quant_method`` when it has one (``requested`` must agree),
    else ``requested``."""
    qc = checkpoint_quantization(hf_config)
    if qc is None:
        if requested in PREQUANTIZED:
            raise ConfigError(f"quantization: {requested!r} needs a checkpoint quantized in that format; this one's "
                              "config.json has no quantization_config")
        return requested
    method = str(qc.get("quant_method", "")).replace("_", "-")
    if method in MODEL_READ:
        return requested
    if method not in PREQUANTIZED:
        raise ConfigError(f"quantization_config.quant_method: {qc.get('quant_method')!r} checkpoints are not "
                          f"supported; supported: {', '.join(PREQUANTIZED)}")
    if requested is not None and requested != method:
        raise ConfigError(f"quantization: {requested!r} does not match the checkpoint's quantization_config "
                          f"(quant_method {method!r}); leave quantization unset or pass {method!r}")
    return method


def parse_config(method: str, qc: dict[str, Any]) -> PrequantConfig:
    if method == "compressed-tensors":
        from model_registry.layers.quantization.compressed_tensors import CompressedTensorsConfig

        return CompressedTensorsConfig(qc)
    if method == "fp8":
        from model_registry.layers.quantization.fp8 import Fp8Config

        return Fp8Config(qc)
    if method == "gptq":
        from model_registry.layers.quantization.gptq import GPTQConfig

        return GPTQConfig(qc)
    from model_registry.layers.quantization.awq import AWQConfig

    return AWQConfig(qc)


def checkpoint_names(module_name: str, layer: LinearBase) -> dict[str | None, str]:
    """Shard -> the checkpoint layer name it is loaded from (a fused layer's q/k/v or gate/up projections)."""
    segments = getattr(layer, "segments", None) or {None: None}
    if set(segments) == {None}:
        return {None: module_name}
    out: dict[str | None, str] = {}
    dotted = module_name + "."
    for part, fused, shard in STACKED_PROJECTIONS:
        if shard in segments and fused in dotted:
            out[shard] = dotted.replace(fused, part)[:-1]
    if set(out) != set(segments):
        raise ConfigError(f"{module_name}: cannot name the checkpoint tensors of its shards {sorted(segments)}")
    return out


def prepare(model: torch.nn.Module, method: str, hf_config: Any) -> list[tuple[LinearBase, PrequantLinearMethod]]:
    """Give each quantized linear layer its placeholders (before loading); returns them for ``finish``."""
    if method not in getattr(model, "supported_quantization", ()):
        raise ConfigError(f"quantization: {type(model).__name__} does not support {method!r} checkpoints")
    qc = checkpoint_quantization(hf_config)
    assert qc is not None
    config = parse_config(method, qc)
    prepared = []
    for name, module in model.named_modules():
        if isinstance(module, ParallelLMHead):
            if config.layer_format("lm_head") is not None and method == "compressed-tensors":
                raise ConfigError("quantization_config: a quantized LM head is not supported (list lm_head in ignore)")
            continue
        if not isinstance(module, LinearBase):
            continue
        names = checkpoint_names(name, module)
        formats = {shard: config.layer_format(n) for shard, n in names.items()}
        kinds = set(formats.values())
        if kinds == {None}:
            continue
        if len(kinds) != 1:
            raise ConfigError(f"quantization_config: {', '.join(names.values())} are fused into one layer but "
                              "have different schemes")
        m = PrequantLinearMethod(kinds.pop(), names, name)  # type: ignore[arg-type]
        m.create_weights(module)
        prepared.append((module, m))
    if not prepared:
        raise ConfigError(f"quantization_config: no linear layer of {type(model).__name__} matches its targets")
    return prepared


def finish(prepared: list[tuple[LinearBase, PrequantLinearMethod]], method: str) -> set[str]:
    """Repack every prepared layer once its tensors are loaded (ConfigError naming a missing one); returns the
    names of the weights that now hold the codes (loaded, for the loader's check)."""
    after, names = 0, set()
    for layer, m in prepared:
        if not m.done:  # some tensor never arrived: named by process_weights_after_loading's error
            m.process_weights_after_loading(layer)
        after += layer.quant_method.weight_bytes(layer)
        names.add(m.module_name + ".weight")
    logger.info("quantization %s (from the checkpoint): %d linear layers, weights %.1f MiB", method, len(prepared),
                after / 2**20)
    return names
