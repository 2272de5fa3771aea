"""The vllite plugin contract, version ``VLLITE_PLUGIN_API``.

A plugin is a module (or object) named by an entry point in group
``vllite.platforms`` (hardware) or ``vllite.plugins`` (everything else). It
declares the API version it was written for as a module attribute::

    VLLITE_PLUGIN_API = (1, 0)

and implements any of the hooks below with ``@vllite_core.plugins.hookimpl``.
A plugin whose major version differs from the core's, or whose minor version is
newer than the core's, is refused with a message naming its distribution.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from model_registry.registry import ModelRegistry
    from vllite_core.config import VlliteConfig
    from vllite_core.platforms.interface import Platform

PROJECT = "vllite"
# 1.1: reasoning parsers, structured output backends, tool parsers (hooks); an attention backend that
# lists fp8 KV caches takes k_scale / v_scale in forward (vllite_core/attention/kv_quant.py)
# 1.2: speculative decoding proposers (vllite_register_spec_proposers); tensor parallelism:
# Platform.device_count() and Platform.make_communicator() (defaults provided), the SupportsTensorParallel
# model capability (vllite_core/model_interfaces.py)
# 1.3: the public layers API for model plugins, ``model_registry.layers`` (its own version LAYERS_API = (1, 0);
# docs/models.md, "The layers package (public API)")
# 1.4: the SupportsExpertParallel model capability (check_expert_parallel; ParallelConfig.enable_expert_parallel)
VLLITE_PLUGIN_API: tuple[int, int] = (1, 4)

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def vllite_register_platforms() -> "list[type[Platform]]":
    """Return the Platform subclasses this plugin provides.

    Every platform plugin answers; the core then asks each class to ``detect()``
    and picks the available one with the highest priority (or the one named by
    ``--device`` / ``VLLITE_PLATFORM``).
    """


@hookspec
def vllite_register_models(registry: "ModelRegistry") -> None:
    """Add model architectures: ``registry.register("LlamaForCausalLM", "pkg.mod:Class")``.

    Entries are lazy import paths, so registering costs nothing until the
    architecture is used. Built-in models are registered through this same hook.
    """


@hookspec
def vllite_register_logits_processors() -> "list[Any]":
    """Return global logits processors (objects or classes) applied to every request, batched."""


@hookspec
def vllite_check_config(config: "VlliteConfig") -> None:
    """Inspect or adjust the engine config after the platform has; raise ConfigError to refuse it."""


@hookspec
def vllite_register_reasoning_parsers() -> "dict[str, type]":
    """Return reasoning parsers by name (``--reasoning-parser NAME``): classes built with the
    model's tokenizer, subclassing ``vllite_core.reasoning.ReasoningParser``. Every plugin
    answers; a later plugin's name replaces an earlier one's. Built-ins: deepseek_r1, qwen3."""


@hookspec
def vllite_register_structured_output_backends() -> "dict[str, type]":
    """Return structured output backends by name: ``{"mybackend": MyBackend}``.

    A backend class follows ``vllite_core.structured_output.backend.StructuredOutputBackend``
    (``check`` a class method; ``compile`` and ``matcher`` on an instance built with the engine's
    tokenizer). The engine uses the one named by ``structured_outputs_config["backend"]``; ``auto``
    tries xgrammar, guidance, outlines, then plugin backends in order. The built-ins register here too.
    """


@hookspec
def vllite_register_tool_parsers() -> "dict[str, type]":
    """Return tool-call parsers by name (``--tool-call-parser NAME``): ``{"hermes": HermesToolParser}``.

    A parser class follows ``vllite_core.tool_parsers.base.ToolParser``: it turns a model's text into
    tool calls, whole and streamed. The built-ins (hermes, llama3_json) register here too.
    """


@hookspec
def vllite_register_spec_proposers() -> "dict[str, Any]":
    """Return speculative-decoding proposers by method name: ``{"mymethod": factory}``.

    ``factory(spec_config, vllite_config)`` builds an object following
    ``vllite_core.spec_decode.proposer.Proposer``: after each step it proposes up to
    ``num_speculative_tokens`` draft tokens per request from the batch's token history; the
    target model verifies them by rejection sampling (lossless whatever the proposer does).
    ``speculative_config={"method": "mymethod", ...}`` selects it. The built-in ngram
    proposer registers here too; a later plugin's name replaces an earlier one's.
    A proposer with a model of its own follows ``vllite_core.spec_decode.model_proposer.ModelProposer``
    instead (``draft_model``, ``eagle``): the runner loads it, gives its KV pages the target's block ids,
    and calls ``propose_step`` after each step.
    """
