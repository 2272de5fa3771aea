"""vllite-plugin-bart: BART and Florence-2 for vllite, registered through the ``vllite.plugins`` entry point.

Importing this module imports no model code (and no torch): the architectures are
registered as lazy ``"module:Class"`` strings, resolved only when a model of that
architecture is loaded.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from vllite_core.plugins import hookimpl

if TYPE_CHECKING:
    from model_registry.registry import ModelRegistry

VLLITE_PLUGIN_API = (1, 3)  # 1.3: its models are built from model_registry.layers
PLUGIN_NAME = "vllite-plugin-bart"

MODELS: dict[str, str] = {
    "BartForConditionalGeneration": "vllite_plugin_bart.bart:BartForConditionalGeneration",
    "Florence2ForConditionalGeneration": "vllite_plugin_bart.florence2:Florence2ForConditionalGeneration",
}


@hookimpl
def vllite_register_models(registry: "ModelRegistry") -> None:
    for architecture, target in MODELS.items():
        registry.register(architecture, target, plugin=PLUGIN_NAME)
