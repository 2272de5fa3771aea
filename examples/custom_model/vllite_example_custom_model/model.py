"""MyLlamaForCausalLM: a Llama variant under its own architecture name.

A model class for vllite's engine takes ``(hf_config, attn_backend, dtype)`` and provides
(``vllite_core.model_interfaces.CausalModel``) ``get_kv_cache_specs(block_size, dtype)`` (one cache spec
per attention layer), ``forward(input_ids, positions, kv_caches, attn_metadata) -> hidden`` (one cache and
one metadata per layer), ``compute_logits(hidden)``, ``load_weights(weights) -> set of loaded parameter
names`` and ``vocab_size``. The simplest way to get all of
that right is to build on a model vllite already has, as here: the computation is Llama's, so the
checkpoint's weights load and run unchanged. Override what differs (a different MLP, an extra norm,
a logits transform...) in a subclass, or write the module from scratch against the same contract.
"""
from __future__ import annotations

from model_registry.models.llama import LlamaForCausalLM


class MyLlamaForCausalLM(LlamaForCausalLM):
    """Llama, served under the name ``MyLlamaForCausalLM`` (checkpoint config: ``model_type: llama``)."""

    architecture = "MyLlamaForCausalLM"
