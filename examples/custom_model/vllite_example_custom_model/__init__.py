"""Example vllite model plugin (entry point ``vllite.plugins: my-llama``).

vllite imports this module in every process that loads plugins, so it only
declares the plugin API version and registers the architecture as a lazy
``"module:Class"`` string: the model code is imported when a checkpoint of this
architecture is actually loaded.
"""
from __future__ import annotations

from vllite_core.plugins import hookimpl

VLLITE_PLUGIN_API = (1, 3)  # the vllite plugin API this package was written for (1.3: model_registry.layers)
PLUGIN_NAME = "vllite-example-custom-model"


@hookimpl
def vllite_register_models(registry) -> None:
    # The key is the name in the checkpoint's config.json "architectures" list.
    registry.register("MyLlamaForCausalLM", "vllite_example_custom_model.model:MyLlamaForCausalLM",
                      plugin=PLUGIN_NAME)
