"""The Transformers fallback (``model_impl="transformers"``): a Hugging Face causal LM class, as transformers
defines it, run by the engine with vllite's paged KV cache.

transformers 5 lets a model's attention modules call any function registered in its ``AttentionInterface``
(classes that do declare ``_supports_attention_backend``). vllite registers one, ``"vllite"``: it takes the
query/key/value a layer computed (rotary already applied), hands them to that layer's ``Attention`` from the
layers package (the platform's paged backend: K/V written to the cache, attention over the request's
blocks) and returns the result to the HF module, which projects it as usual. Everything else (embeddings,
norms, MLPs, positions) is transformers' own code. The step's caches and metadata reach the function as a
keyword argument that transformers passes from the base model's ``forward`` down to each attention call.

All requests' tokens arrive flattened as one batch row with their own positions; attention is the only
place tokens of one request meet another's, and it goes through the paged backend, so the HF model never
needs a padding mask (transformers builds none for an attention implementation without a mask function).
"""
from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from model_registry.layers import Attention, ReplicatedLinear
from model_registry.layers.params import load_by_name
from model_registry.models.transformers_tp import (
    FallbackColumnLinear,
    FallbackRowLinear,
    check_tp_plan,
    shard_linears,
)
from model_registry.registry import UnknownArchitectureError
from vllite_core.attention.backend import AttentionBackend, AttentionMetadata
from vllite_core.core.kv_cache_spec import KVCacheSpec
from vllite_core.distributed import get_tp
from vllite_core.errors import ConfigError
from vllite_core.model_interfaces import SupportsLoRA, SupportsTensorParallel

logger = logging.getLogger("vllite.model_registry")

ATTN_IMPLEMENTATION = "vllite"  # the name vllite's attention function is registered under in transformers
STEP_KWARG = "vllite_step"  # the keyword argument that carries one step's caches and metadata
_ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


class FallbackUnavailableError(ConfigError, UnknownArchitectureError):
    """The Transformers fallback cannot run this model; the message says why. An ``UnknownArchitectureError``
    too where no native class is registered either (``model_impl="auto"``)."""


@dataclass(frozen=True)
class FallbackStep:
    """One forward pass's view of the paged cache: layer ``i``'s ``Attention``, cache tensor and metadata."""

    layers: nn.ModuleList
    kv_caches: list[torch.Tensor]
    metadata: list[AttentionMetadata]


def paged_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None,
                            dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [1, H, T, D], key/value [1, Hkv, T, D] with rotary
    applied (GQA heads not repeated) -> ([1, T, H, D], no weights). Computed by layer ``module.layer_idx``'s
    ``Attention`` over the paged cache; ``attention_mask`` is None (causality comes from the metadata)."""
    step: FallbackStep | None = kwargs.get(STEP_KWARG)
    if step is None:
        raise RuntimeError(f"attn_implementation={ATTN_IMPLEMENTATION!r} runs only inside vllite's engine "
                           f"(the forward call must pass {STEP_KWARG}=...)")
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise NotImplementedError(f"{type(module).__name__}: attention logit soft-capping and attention sinks "
                                  "are not supported by the Transformers fallback")
    idx = module.layer_idx
    layer: Attention = step.layers[idx]
    if scaling is not None:
        layer.scale = scaling
    out = layer.forward(query[0].transpose(0, 1).contiguous(), key[0].transpose(0, 1).contiguous(),
                        value[0].transpose(0, 1).contiguous(), step.kv_caches[idx], step.metadata[idx])
    return out.unsqueeze(0), None


def register_attention_function() -> None:
    """Make ``attn_implementation="vllite"`` known to transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


# ---- which models the fallback takes ---------------------------------------------------------------


def hf_causal_lm_class(hf_config: Any, trust_remote_code: bool) -> type:
    """The transformers class the fallback builds for ``hf_config``, or ``FallbackUnavailableError`` naming
    why it cannot (not a causal LM, remote code not trusted, no custom-attention support, a layer kind the
    paged cache does not hold)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    archs = list(getattr(hf_config, "architectures", None) or [])
    if not archs:
        raise FallbackUnavailableError("the model config lists no architectures, so the Transformers fallback "
                                       "does not know which class to build")
    arch = archs[0]
    auto_map = getattr(hf_config, "auto_map", None) or {}
    if getattr(hf_config, "is_encoder_decoder", False):
        raise FallbackUnavailableError(f"{arch} is an encoder-decoder model; the Transformers fallback runs "
                                       "decoder-only causal LMs")
    builtin = getattr(transformers, arch, None)
    if isinstance(builtin, type) and arch in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()):
        cls = builtin
    elif "AutoModelForCausalLM" in auto_map:
        if not trust_remote_code:
            raise FallbackUnavailableError(
                f"{arch} is defined by the model's own code (config.auto_map names "
                f"{auto_map['AutoModelForCausalLM']!r}); the Transformers fallback runs it only with "
                "trust_remote_code=True (--trust-remote-code), which executes that code")
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        cls = get_class_from_dynamic_module(auto_map["AutoModelForCausalLM"], hf_config._name_or_path)
    elif isinstance(builtin, type):
        raise FallbackUnavailableError(f"{arch} is not a causal language model class of transformers "
                                       f"{transformers.__version__} (the fallback runs AutoModelForCausalLM classes)")
    else:
        raise FallbackUnavailableError(f"transformers {transformers.__version__} has no class {arch} and the "
                                       "config names no remote code (config.auto_map) for AutoModelForCausalLM")
    if not getattr(cls, "_supports_attention_backend", False):
        raise FallbackUnavailableError(
            f"{arch}: its transformers class does not accept a custom attention function "
            "(_supports_attention_backend is not set), so vllite's paged attention cannot be plugged in")
    text = hf_config.get_text_config()
    if text is not hf_config:
        raise FallbackUnavailableError(f"{arch} nests a text config (a multimodal model); the Transformers "
                                       "fallback runs text-only causal LMs")
    others = sorted(set(getattr(text, "layer_types", None) or ()) - set(_ATTENTION_LAYER_TYPES))
    if others:
        raise FallbackUnavailableError(f"{arch} has layers of kind {', '.join(others)}; the Transformers fallback "
                                       "runs models whose every layer is (full or sliding-window) attention")
    if getattr(text, "attn_logit_softcapping", None):
        raise FallbackUnavailableError(f"{arch} soft-caps attention logits (attn_logit_softcapping), which the "
                                       "paged attention backends do not do")
    return cls


def fallback_model_class(hf_config: Any, trust_remote_code: bool) -> type["TransformersForCausalLM"]:
    """An engine model class that builds ``hf_config``'s transformers class (``FallbackUnavailableError`` when
    the fallback cannot take it)."""
    hf_class = hf_causal_lm_class(hf_config, trust_remote_code)
    return type(f"Transformers{hf_class.__name__}", (TransformersForCausalLM,), {"hf_class": hf_class})


def _layer_windows(text: Any, num_layers: int) -> list[int | None]:
    """Each layer's sliding window as transformers' configs state it: per layer type, or one for all."""
    window = getattr(text, "sliding_window", None)
    layer_types = getattr(text, "layer_types", None)
    if layer_types:
        return [int(window) if t == "sliding_attention" and window else None for t in layer_types[:num_layers]]
    if not window or getattr(text, "use_sliding_window", True) is False:
        return [None] * num_layers
    return [int(window)] * num_layers


# ---- the engine model --------------------------------------------------------------------------------


class _AdaptableLinear(ReplicatedLinear):
    """An HF ``nn.Linear`` turned into a layer with a LoRA slot (its parameters kept): HF modules pass
    [batch, tokens, features], the LoRA op takes token rows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)


class TransformersForCausalLM(nn.Module, SupportsLoRA, SupportsTensorParallel):
    """The engine's contract around a transformers causal LM (``hf_class``, set by ``fallback_model_class``):
    one ``Attention`` per decoder layer for the paged cache, the HF base model for hidden states, its output
    embeddings for logits. On several ranks its linear layers shard by transformers' own plan
    (``model_registry.models.transformers_tp``)."""

    hf_class: type

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        from transformers.initialization import no_init_weights

        register_attention_function()
        config = copy.deepcopy(hf_config)  # transformers records dtype and attention choice on the config
        with no_init_weights():  # the checkpoint fills every parameter
            self.hf = self.hf_class._from_config(config, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION)
        self.hf.tie_weights()  # what init_weights would have done: a tied head shares the embedding's table
        self.hf.eval()
        tp = get_tp().world_size
        if tp > 1:
            logger.info("Transformers fallback: %d linear layers of %s sharded over %d ranks by transformers' "
                        "tensor-parallel plan", shard_linears(self.hf.base_model, config, dtype),
                        self.hf_class.__name__, tp)
        text = config.get_text_config()
        num_heads = text.num_attention_heads // tp  # this rank's (the plan splits heads evenly)
        num_kv_heads = (getattr(text, "num_key_value_heads", None) or text.num_attention_heads) // tp
        head_size = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        num_layers = text.num_hidden_layers
        windows = _layer_windows(text, num_layers)
        self.attn_layers = nn.ModuleList(Attention(num_heads, num_kv_heads, head_size, attn_backend,
                                                   sliding_window=windows[i]) for i in range(num_layers))
        self.vocab_size: int = text.vocab_size
        self.dtype = dtype
        # Logit scaling that transformers' ForCausalLM.forward applies after the head (not part of the head).
        self._logit_scale = float(getattr(text, "logit_scale", None) or 1.0)  # Cohere: multiplies
        self._logits_scaling = float(getattr(text, "logits_scaling", None) or 1.0)  # Granite: divides
        self._final_softcap = getattr(text, "final_logit_softcapping", None)  # Gemma 2/3: tanh cap
        self._lora_targets: dict[str, tuple[str, int, int]] | None = None

    @classmethod
    def check_tensor_parallel(cls, hf_config: Any, tensor_parallel_size: int) -> None:
        """SupportsTensorParallel: ConfigError unless transformers' plan shards this model over the ranks."""
        check_tp_plan(cls.hf_class.__name__, hf_config, tensor_parallel_size)

    def get_kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec]:
        """One paged cache per decoder layer (sliding-window layers in their own group)."""
        return [layer.kv_cache_spec(block_size, dtype) for layer in self.attn_layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: list[AttentionMetadata]) -> torch.Tensor:
        """Hidden states [T, hidden] for the step's flattened tokens (one HF batch row, engine positions)."""
        step = FallbackStep(self.attn_layers, kv_caches, attn_metadata)
        out = self.hf.base_model(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0),
                                 use_cache=False, return_dict=True, **{STEP_KWARG: step})
        return out.last_hidden_state[0]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.hf.get_output_embeddings()(hidden_states)
        if self._logit_scale != 1.0:
            logits = logits * self._logit_scale
        if self._logits_scaling != 1.0:
            logits = logits / self._logits_scaling
        if self._final_softcap:
            logits = torch.tanh(logits / self._final_softcap) * self._final_softcap
        return logits

    def lora_targets(self) -> dict[str, tuple[str, int, int]]:
        """SupportsLoRA: each linear layer of the HF base model by its transformers name (what a PEFT adapter
        names) -> that layer, all its rows. Asked only when the engine serves adapters, after loading: then each
        ``nn.Linear`` of the base model becomes an ``_AdaptableLinear`` holding the same parameters (without
        LoRA the HF modules stay untouched); the layers sharded over ranks (``transformers_tp``) have their own
        slot, this rank's rows of it."""
        if self._lora_targets is None:
            base = self.hf.base_model
            prefix = "" if base is self.hf else f"{self.hf.base_model_prefix}."
            targets = {}
            for name, module in list(base.named_modules()):
                if isinstance(module, (FallbackColumnLinear, FallbackRowLinear)):  # sharded: it has a LoRA slot
                    targets[prefix + name] = (f"hf.{prefix}{name}", 0, module.local_features[0])
                    continue
                if type(module) is not nn.Linear:
                    continue
                with torch.device(module.weight.device):
                    layer = _AdaptableLinear(module.in_features, module.out_features, False, self.dtype)
                layer.weight, layer.bias = module.weight, module.bias
                parent, _, child = name.rpartition(".")
                setattr(base.get_submodule(parent) if parent else base, child, layer)
                targets[prefix + name] = (f"hf.{prefix}{name}", 0, module.out_features)
            self._lora_targets = targets
        return self._lora_targets

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint tensors renamed as transformers' own loading renames them (the class's checkpoint
        conversion mapping, the ``base_model_prefix`` added or dropped), copied into the HF parameters and
        persistent buffers; returns the parameter names filled, tied aliases (a head tied to the embedding)
        included. A tensor transformers would convert (experts merged from separate tensors, say) is an error
        naming it, never silently dropped."""
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key

        transforms = get_model_conversion_mapping(self.hf)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
        state = self.hf.state_dict()
        buffers = dict(self.hf.named_buffers())
        prefix = getattr(self.hf, "base_model_prefix", None) or None

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                hf_name, converted = rename_source_key(name, renamings, converters, prefix, state)
                if converted is not None:
                    raise ValueError(f"checkpoint tensor {name}: transformers converts it on load ({converted!r}), "
                                     "which the Transformers fallback does not do")
                if hf_name in buffers:
                    with torch.no_grad():
                        buffers[hf_name].copy_(tensor)
                    continue
                yield hf_name, tensor

        loaded = load_by_name(self, tensors(), lambda n: "hf." + n)
        named = list(self.named_parameters(remove_duplicate=False))
        filled = {id(p) for name, p in named if name in loaded}
        return loaded | {name for name, p in named if id(p) in filled}
