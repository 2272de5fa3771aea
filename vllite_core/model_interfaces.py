"""What a model class is, declared by the classes it inherits, checked once when it is resolved.

Every engine model is a ``CausalModel`` (the decoder contract the runner drives).
Extra capabilities are small Protocols a model class inherits explicitly
(``class WhisperForConditionalGeneration(nn.Module, SupportsEncoderDecoder)``):
declared, not probed. ``model_capabilities(cls)`` checks the declarations against
the members each one needs (a clear error names a missing one) and returns a
``ModelCapabilities`` record that the engine keeps in ``ModelConfig.capabilities``;
components read that record, never the model object.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from vllite_core.attention.backend import AttentionMetadata
    from vllite_core.core.kv_cache_spec import KVCacheSpec
    from vllite_core.inputs import InputContext, ProcessedPrompt


class CausalModel(Protocol):
    """The contract of every generative engine model (``model_registry`` builds it as
    ``cls(hf_config, attn_backend, dtype)``)."""

    vocab_size: int

    def get_kv_cache_specs(self, block_size: int, dtype: "torch.dtype") -> "list[KVCacheSpec]":
        """One spec per cache-holding layer, in the order of ``forward``'s ``kv_caches``."""

    def forward(self, input_ids: "torch.Tensor", positions: "torch.Tensor", kv_caches: "list[torch.Tensor]",
                attn_metadata: "list[AttentionMetadata]") -> "torch.Tensor":
        """Hidden states for the step's flattened tokens; ``kv_caches[i]`` and ``attn_metadata[i]`` belong
        to layer ``i`` of ``get_kv_cache_specs`` (layers of one cache group share a metadata object)."""

    def compute_logits(self, hidden_states: "torch.Tensor") -> "torch.Tensor": ...

    def load_weights(self, weights: Any) -> set[str]: ...


class ProcessesPrompts(Protocol):
    """Turns a user prompt into decoder ids plus what its encoder consumes (``vllite_core.inputs``)."""

    @classmethod
    def process_prompt(cls, prompt: Any, ctx: "InputContext") -> "ProcessedPrompt": ...


class SupportsEncoderDecoder(ProcessesPrompts, Protocol):
    """An encoder runs once per request; decoder layers cross-attend to its output (``CrossAttentionSpec``
    layers). The engine turns chunked prefill and prefix caching off for such models."""


    @classmethod
    def get_max_model_len(cls, hf_config: Any) -> int:
        """The decoder's positions (the encoder's window is separate)."""

    def encode(self, encoder_inputs: list[Any]) -> "list[torch.Tensor]": ...

    def cross_kv(self, encoder_hidden: "torch.Tensor") -> "list[tuple[torch.Tensor, torch.Tensor]]":
        """Per cross-attention layer (in spec order), its (K, V) from one encoder output."""


class SupportsMultiModal(ProcessesPrompts, Protocol):
    """Takes images (or other media) in its prompts."""


class SupportsMultiModalDecoder(SupportsMultiModal, Protocol):
    """A decoder that reads media through embeddings in its prompt (Llava): ``process_prompt`` expands each
    item's placeholder and records ``ProcessedPrompt.mm_features``; the runner calls ``embed_multimodal`` on the
    items the scheduler encodes (kept in the encoder cache) and passes ``forward(..., inputs_embeds=)`` with
    their rows in place of the placeholders."""

    supported_modalities: tuple[str, ...]  # e.g. ("image",)

    def embed_multimodal(self, data: list[Any]) -> "list[torch.Tensor]":
        """Per item (its ``MultiModalFeature.data``), its embeddings [feature length, hidden]."""

    def embed_input_ids(self, input_ids: "torch.Tensor") -> "torch.Tensor": ...

    @classmethod
    def image_token_id(cls, hf_config: Any) -> int:
        """The placeholder token that stands for an image in a prompt (one per image; the model expands it):
        the config's ``image_token_id`` unless the model reads another field (Llava: ``image_token_index``)."""
        return int(hf_config.image_token_id)

    @classmethod
    def chat_image_token_ids(cls, hf_config: Any) -> list[int]:
        """What a chat prompt holds per image part: the placeholder alone unless the model wraps it
        (Qwen2-VL: vision start, placeholder, vision end). Inherited by the classes that declare the Protocol."""
        return [cls.image_token_id(hf_config)]

    @classmethod
    def chat_audio_token_ids(cls, hf_config: Any, tokenizer: Any) -> list[int]:
        """What a chat prompt holds per audio part (``input_audio``, ``audio_url``); only asked of a model whose
        ``supported_modalities`` include "audio" (Qwen2-Audio: audio start, placeholder, audio end)."""
        raise NotImplementedError(f"{cls.__name__} does not take audio")


class HasBidirectionalMMItems(Protocol):
    """Each multimodal item's placeholder tokens attend to one another (Gemma 3's images): the scheduler never
    splits an item's placeholders across steps, and the model marks them as non-causal spans in the step's
    attention metadata (``vllite_core.attention.spans``)."""


class SupportsMRoPE(Protocol):
    """Rotary positions in three dimensions (temporal, height, width: Qwen2-VL). The runner asks once per
    request for its prompt's positions and the delta its later tokens add to their index (vLLM's names), and
    passes ``forward`` [3, T] positions in steps holding such prompt tokens, [T] (index + delta) otherwise."""

    def get_mrope_input_positions(self, input_tokens: list[int], mm_features: list[Any]
                                  ) -> "tuple[torch.Tensor, int]":
        """([3, len(input_tokens)] positions of the prompt, the delta of every token after it)."""


class SupportsTranscription(Protocol):
    """Serves ``LLM.transcribe`` and ``/v1/audio/transcriptions``."""


    @classmethod
    def max_audio_seconds(cls, ctx: "InputContext") -> float: ...

    @classmethod
    def language_detection_prompt(cls, ctx: "InputContext") -> tuple[list[int], dict[int, str]]: ...


class SupportsLoRA(Protocol):
    """Its linear layers take per-row LoRA adapters (vllite_core/lora): each adaptable layer has a ``lora``
    attribute (None, or the layer the engine attaches) and calls ``y = lora(x, y)`` after its base product."""

    def lora_targets(self) -> dict[str, tuple[str, int, int]]:
        """Each HF projection name an adapter may target (``model.layers.0.self_attn.q_proj``) -> (the engine
        module holding it, its first and past-last output rows there: fused q/k/v, gate/up)."""


class SupportsTensorParallel(Protocol):
    """Its layers shard over tensor-parallel ranks (``model_registry.layers.linear``): built on each rank,
    it holds and loads that rank's slice. A model class that does not declare it runs on one rank only."""

    @classmethod
    def check_tensor_parallel(cls, hf_config: Any, tensor_parallel_size: int) -> None:
        """Raise ``ConfigError`` (naming ``tensor_parallel_size``) if this checkpoint cannot be split so."""


class SupportsExpertParallel(Protocol):
    """Its mixture-of-experts layers can hold whole experts per rank instead of every expert's slice
    (``ParallelConfig.enable_expert_parallel``); the engine asks it before any worker starts."""

    @classmethod
    def check_expert_parallel(cls, hf_config: Any, tensor_parallel_size: int) -> None:
        """Raise ``ConfigError`` (naming ``enable_expert_parallel``) if the experts cannot be placed so."""


class IsStateful(Protocol):
    """Keeps a recurrent state per request (Mamba and hybrids, ``StateSpec`` layers): no prefix caching."""


class IsPooling(Protocol):
    """Produces embeddings or scores instead of next-token logits (``vllite_core.pooling``). Its requests
    are prefill-only: when a prompt's last chunk has run, ``pool`` turns each finished request's hidden
    rows of that step into its raw result (an embedding, or class logits), and the request finishes."""

    pooling_task: str  # "embed" | "classify" | "reward"
    default_pooling_type: str  # "CLS" | "MEAN" | "LAST" | "ALL" (a sentence-transformers folder may override)
    is_bidirectional: bool  # every token sees the whole prompt: one step per prompt, no prefix caching

    def pool(self, hidden: "list[torch.Tensor]", cfg: Any) -> "list[torch.Tensor]":
        """Per request, its hidden rows of this step (the whole prompt unless ``cfg.pooling_type`` is LAST)
        -> its raw pooled output. ``cfg``: the engine's ``PoolerConfig``."""


@dataclass(frozen=True)
class ModelCapabilities:
    """The answers, recorded once per engine in ``ModelConfig.capabilities``."""

    processes_prompts: bool = False
    is_encoder_decoder: bool = False
    supports_multimodal: bool = False
    is_multimodal_decoder: bool = False  # media as prompt embeddings: encoder cache, image-aware block hashes
    uses_mrope: bool = False  # three-dimensional rotary positions, a per-request position delta
    mm_items_bidirectional: bool = False  # an item's placeholders are scheduled in one step (non-causal spans)
    supports_transcription: bool = False
    supports_lora: bool = False
    supports_tensor_parallel: bool = False
    supports_expert_parallel: bool = False
    is_stateful: bool = False
    is_pooling: bool = False


_DECLARATIONS: dict[str, tuple[type, tuple[str, ...]]] = {
    "is_encoder_decoder": (SupportsEncoderDecoder, ("process_prompt", "get_max_model_len", "encode", "cross_kv")),
    "is_multimodal_decoder": (SupportsMultiModalDecoder, ("process_prompt", "supported_modalities",
                                                          "embed_multimodal", "embed_input_ids")),
    "supports_multimodal": (SupportsMultiModal, ("process_prompt",)),
    "uses_mrope": (SupportsMRoPE, ("get_mrope_input_positions",)),
    "mm_items_bidirectional": (HasBidirectionalMMItems, ()),
    "supports_transcription": (SupportsTranscription, ("max_audio_seconds", "language_detection_prompt")),
    "supports_lora": (SupportsLoRA, ("lora_targets",)),
    "supports_tensor_parallel": (SupportsTensorParallel, ("check_tensor_parallel",)),
    "supports_expert_parallel": (SupportsExpertParallel, ("check_expert_parallel",)),
    "is_stateful": (IsStateful, ()),
    "is_pooling": (IsPooling, ("pool", "pooling_task", "default_pooling_type", "is_bidirectional")),
    # Last: the Protocols above that build on it name themselves in the error.
    "processes_prompts": (ProcessesPrompts, ("process_prompt",)),
}
_REQUIRED = ("get_kv_cache_specs", "forward", "compute_logits", "load_weights")


def _declares(model_cls: type, proto: type) -> bool:
    return proto in getattr(model_cls, "__mro__", ())


def _defined(model_cls: type, name: str) -> bool:
    """Defined by the model (or a base of its own), not only as a Protocol's empty stub."""
    for klass in model_cls.__mro__:
        if name in vars(klass):
            return not vars(klass).get("_is_protocol", False)
    return False


def model_capabilities(model_cls: type) -> ModelCapabilities:
    """Check ``model_cls``'s declarations; TypeError naming the class and the missing member otherwise."""
    name = getattr(model_cls, "__qualname__", repr(model_cls))
    for member in _REQUIRED:
        if not _defined(model_cls, member):
            raise TypeError(f"model class {name} does not define {member}(), which every engine model needs")
    found: dict[str, bool] = {}
    for field, (proto, members) in _DECLARATIONS.items():
        found[field] = _declares(model_cls, proto)
        if found[field]:
            missing = [m for m in members if not _defined(model_cls, m)]
            if missing:
                raise TypeError(f"model class {name} declares {proto.__name__} but does not define "
                                f"{', '.join(missing)}")
    return ModelCapabilities(**found)
