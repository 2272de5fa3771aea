"""MyLlamaForCausalLM: a Llama variant under its own architecture name.

A model class for vllite's engine takes ``(hf_config, attn_backend, dtype)`` and provides
``forward(input_ids, positions, kv_caches, attn_metadata) -> hidden``, ``compute_logits(hidden)``,
``load_weights(weights) -> set of loaded parameter names`` and the cache geometry attributes
(``num_layers``, ``num_kv_heads``, ``head_size``, ``vocab_size``). The simplest way to get all of
that right is to build on a model vllite already has, as here: the computation is Llama's, so the
checkpoint's weights load and run unchanged. Override what differs (a different MLP, an extra norm,
a logits transform...) in a subclass, or write the module from scratch against the same contract.
"""
from __future__ import annotations

from model_registry.models.llama import LlamaForCausalLM


class MyLlamaForCausalLM(LlamaForCausalLM):
    """Llama, served under the name ``MyLlamaForCausalLM`` (checkpoint config: ``model_type: llama``)."""

    architecture = "MyLlamaForCausalLM"
