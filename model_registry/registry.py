"""Architecture name -> model class, filled by plugins, imported lazily.

Plugins (built-in ones included) register ``"module:Class"`` strings through the
``vllite_register_models`` hook, so listing or registering models imports no
model code; ``resolve`` imports the one architecture actually used.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

PLUGIN_GROUP = "vllite.plugins"

# Architectures served by out-of-tree plugins: named in the error when they are missing.
KNOWN_PLUGIN_ARCHITECTURES: dict[str, str] = {
    "BartForConditionalGeneration": "vllite-plugin-bart",
    "Florence2ForConditionalGeneration": "vllite-plugin-bart",
}


class UnknownArchitectureError(ValueError):
    """No plugin registered this architecture."""


class ModelResolutionError(ImportError):
    """A registered architecture's target could not be imported."""


@dataclass(frozen=True)
class ModelEntry:
    architecture: str
    target: str | type
    plugin: str | None


class ModelRegistry:
    """The architectures this process can run."""

    def __init__(self) -> None:
        self._entries: dict[str, ModelEntry] = {}
        self._resolved: dict[str, type] = {}

    def register(self, architecture: str, target: str | type, *, plugin: str | None = None) -> None:
        """Map ``architecture`` (an HF ``config.architectures`` name) to ``"module:Class"`` or a class.

        Registering an architecture again replaces the entry: a later plugin may override a built-in.
        """
        if isinstance(target, str) and (target.count(":") != 1 or not all(target.split(":"))):
            raise ValueError(f"model target for {architecture!r} must look like 'package.module:Class', got {target!r}")
        if not isinstance(target, (str, type)):
            raise TypeError(f"model target for {architecture!r} must be a 'module:Class' string or a class")
        self._entries[architecture] = ModelEntry(architecture, target, plugin)
        self._resolved.pop(architecture, None)

    def architectures(self) -> list[str]:
        return sorted(self._entries)

    def entry(self, architecture: str) -> ModelEntry:
        try:
            return self._entries[architecture]
        except KeyError:
            raise UnknownArchitectureError(self._unknown_message([architecture])) from None

    def __contains__(self, architecture: object) -> bool:
        return architecture in self._entries

    def resolve(self, architecture: str) -> type:
        """The model class for ``architecture``, importing its module on first use."""
        if architecture in self._resolved:
            return self._resolved[architecture]
        entry = self.entry(architecture)
        target = entry.target
        if isinstance(target, str):
            module_name, _, attr = target.partition(":")
            try:
                cls = getattr(importlib.import_module(module_name), attr)
            except (ImportError, AttributeError) as e:
                origin = f" (registered by {entry.plugin})" if entry.plugin else ""
                raise ModelResolutionError(f"cannot import {target!r} for {architecture}{origin}: {e}") from e
        else:
            cls = target
        self._resolved[architecture] = cls
        return cls

    def resolve_for_config(self, hf_config: Any) -> tuple[str, type]:
        """(architecture, class) for the first of ``hf_config.architectures`` that is registered."""
        archs = list(getattr(hf_config, "architectures", None) or [])
        if not archs:
            raise UnknownArchitectureError(
                "the model config lists no architectures (config.architectures is empty); "
                f"known architectures: {', '.join(self.architectures()) or '(none)'}")
        for arch in archs:
            if arch in self._entries:
                return arch, self.resolve(arch)
        raise UnknownArchitectureError(self._unknown_message(archs))

    def _unknown_message(self, archs: list[str]) -> str:
        names = ", ".join(archs)
        msg = [f"model architecture {names} is not supported by the installed plugins. "
               f"Known architectures: {', '.join(self.architectures()) or '(none)'}."]
        plugins = sorted({KNOWN_PLUGIN_ARCHITECTURES[a] for a in archs if a in KNOWN_PLUGIN_ARCHITECTURES})
        if plugins:
            msg.append(f" {names} is provided by the plugin package {', '.join(plugins)}: "
                       f"install it (pip install {' '.join(plugins)}).")
        msg.append(f" To add an architecture, install a plugin that implements the `vllite_register_models` hook "
                   f"and is exposed in the entry-point group {PLUGIN_GROUP!r}.")
        return "".join(msg)


def build_registry(pm: Any) -> ModelRegistry:
    """A registry filled by every loaded plugin's ``vllite_register_models`` hook (``pm``: a pluggy manager)."""
    registry = ModelRegistry()
    pm.hook.vllite_register_models(registry=registry)
    return registry
