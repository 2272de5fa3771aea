"""Which implementation runs a model: vLLM's ``model_impl`` switch.

- ``"vllite"``: the class the registry holds for the architecture (``UnknownArchitectureError`` otherwise);
- ``"transformers"``: the Transformers fallback (``model_registry.models.transformers_fallback``), even when a
  native class is registered;
- ``"auto"`` (default): the registered class when there is one, else the fallback.

The choice and its reason are logged at start-up and shown by ``vllite env --model``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from model_registry.registry import ModelRegistry, UnknownArchitectureError
from vllite_core.config import MODEL_IMPLS
from vllite_core.errors import ConfigError

logger = logging.getLogger("vllite.model_registry")


@dataclass(frozen=True)
class ModelImplChoice:
    """The class that will run the model and why: ``impl`` is ``"vllite"`` (a registered class) or
    ``"transformers"`` (the fallback)."""

    architecture: str
    model_cls: type
    impl: str
    reason: str

    def describe(self) -> str:
        what = "vllite (native)" if self.impl == "vllite" else "transformers (Transformers fallback)"
        return f"{self.architecture}: {what}: {self.reason}"


def check_model_impl(model_impl: str) -> None:
    if model_impl not in MODEL_IMPLS:
        raise ConfigError(f"model_impl: must be one of {', '.join(MODEL_IMPLS)}, got {model_impl!r}")


def resolve_model_impl(registry: ModelRegistry, hf_config: Any, model_impl: str = "auto",
                       trust_remote_code: bool = False) -> ModelImplChoice:
    """The implementation ``model_impl`` asks for (see the module docstring). Errors: ``ConfigError`` for a bad
    value; ``FallbackUnavailableError`` (a ``ConfigError`` and an ``UnknownArchitectureError``) naming the
    reason when the fallback is asked for, or is the only choice left, and cannot take the model;
    ``UnknownArchitectureError`` for ``"vllite"`` without a registered class."""
    from model_registry.models.transformers_fallback import FallbackUnavailableError, fallback_model_class

    check_model_impl(model_impl)
    archs = list(getattr(hf_config, "architectures", None) or [])
    if model_impl == "transformers":
        cls = fallback_model_class(hf_config, trust_remote_code)
        return _chosen(ModelImplChoice(archs[0], cls, "transformers", "model_impl='transformers' asked for it"))
    try:
        arch, cls = registry.resolve_for_config(hf_config)
    except UnknownArchitectureError as e:
        if not archs:
            raise
        if model_impl == "vllite":
            raise UnknownArchitectureError(f"{e} (model_impl='vllite' asked for a native implementation; "
                                           "model_impl='auto' or 'transformers' tries the Transformers "
                                           "fallback)") from None
        try:
            cls = fallback_model_class(hf_config, trust_remote_code)
        except FallbackUnavailableError as why:
            raise FallbackUnavailableError(f"{e} The Transformers fallback (model_impl='auto') cannot run it "
                                           f"either: {why}") from None
        return _chosen(ModelImplChoice(archs[0], cls, "transformers",
                                       "no native implementation is registered for it"))
    return _chosen(ModelImplChoice(arch, cls, "vllite", "a native implementation is registered"
                                   + (" (model_impl='vllite')" if model_impl == "vllite" else "")))


def _chosen(choice: ModelImplChoice) -> ModelImplChoice:
    if choice.impl == "transformers":
        logger.info("Using the Transformers fallback for %s (%s): transformers' %s with vllite's paged "
                    "attention", choice.architecture, choice.reason, choice.model_cls.hf_class.__name__)
    return choice


def apply_fallback_rules(config: Any, choice: ModelImplChoice) -> None:
    """For the Transformers fallback: a ConfigError naming an option it does not support, and graph capture
    off (transformers' forward is not known to replay correctly from a captured graph)."""
    if choice.impl != "transformers":
        return
    arch = choice.architecture
    mc = config.model_config
    if mc.quantization is not None:
        raise ConfigError(f"quantization: {mc.quantization!r} is not supported by the Transformers fallback ({arch})")
    if mc.runner == "pooling" or mc.convert not in ("auto", "none"):
        raise ConfigError(f"runner: the Transformers fallback serves {arch} as a generative model only "
                          "(runner='generate')")
    if config.speculative_config is not None and config.speculative_config.method != "ngram":
        raise ConfigError(f"speculative_config: the Transformers fallback ({arch}) supports only the ngram method")
    if not config.enforce_eager:
        logger.info("The Transformers fallback runs %s without captured graphs (enforce_eager)", arch)
        config.enforce_eager = True
