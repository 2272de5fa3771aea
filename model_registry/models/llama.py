"""The Llama family (Llama, Mistral, Qwen2) written for the engine.

Tokens of all requests arrive flattened ([T], no padding) with their positions;
attention goes through the platform's ``AttentionBackend`` over a paged KV
cache. q/k/v and gate/up projections are fused into one matmul each; HF
checkpoint names are mapped onto the fused weights in ``load_weights``.
Differences inside the family are config switches: Qwen2 has q/k/v bias (and
optional per-layer sliding windows), Mistral may have a sliding window.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from model_registry.layers import (
    Attention,
    DecoderLayerRecord,
    GatedMLP,
    NormRecord,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    ShardsByHeads,
    VocabParallelEmbedding,
)
from model_registry.layers.params import STACKED_PROJECTIONS, load_by_name
from model_registry.layers.pipeline import StageLayers
from vllite_core.attention.backend import AttentionBackend, AttentionMetadata
from vllite_core.attention.kv_quant import kv_scale_name
from vllite_core.core.kv_cache_spec import KVCacheSpec
from vllite_core.distributed.pipeline import IntermediateTensors
from vllite_core.model_interfaces import SupportsLoRA
from vllite_core.model_ops import current_model_ops


def _layer_windows(hf_config: Any, num_layers: int) -> list[int | None]:
    """Sliding window per layer: Qwen2 lists layer types, Mistral applies one window to all layers."""
    window = getattr(hf_config, "sliding_window", None)
    if not window:
        return [None] * num_layers
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types:
        return [int(window) if t == "sliding_attention" else None for t in layer_types[:num_layers]]
    return [int(window)] * num_layers


class LlamaAttention(nn.Module):
    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype,
                 sliding_window: int | None) -> None:
        super().__init__()
        c = hf_config
        num_heads = c.num_attention_heads
        num_kv_heads = getattr(c, "num_key_value_heads", None) or num_heads
        self.head_size = getattr(c, "head_dim", None) or c.hidden_size // num_heads
        is_qwen2 = getattr(c, "model_type", "") in ("qwen2", "qwen2_vl_text", "qwen2_5_vl_text")
        qkv_bias = is_qwen2 or bool(getattr(c, "attention_bias", False))
        o_bias = not is_qwen2 and bool(getattr(c, "attention_bias", False))
        # This rank's heads (all of them on one rank): vllite_core.distributed.sharding.shard_heads.
        self.qkv_proj = QKVParallelLinear(c.hidden_size, self.head_size, num_heads, num_kv_heads, qkv_bias, dtype)
        heads = self.qkv_proj.heads
        self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads
        self.q_size = self.num_heads * self.head_size
        self.kv_size = self.num_kv_heads * self.head_size
        self._head_split = [self.num_heads, self.num_kv_heads, self.num_kv_heads]
        q_cols = (heads.q_start * self.head_size, heads.q_start * self.head_size + self.q_size)
        self.o_proj = RowParallelLinear(num_heads * self.head_size, c.hidden_size, o_bias, dtype, q_cols)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_size, attn_backend,
                              sliding_window=sliding_window)
        self._ops = current_model_ops()

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        # Children are called through .forward (no module hooks): a decode step makes ~9 such calls per
        # layer, and nn.Module.__call__ costs about a microsecond each. One view and one split give the
        # heads (three splits and three views cost twice that).
        q, k, v = self.qkv_proj.forward(x).view(t, -1, self.head_size).split_with_sizes(self._head_split, 1)
        q, k = self._ops.rotary(q, k, *rope)
        out = self.attn.forward(q, k, v, kv_cache, attn_metadata)
        return self.o_proj.forward(out.reshape(t, self.q_size))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype,
                 sliding_window: int | None) -> None:
        super().__init__()
        eps = float(getattr(hf_config, "rms_norm_eps", 1e-6))
        self.input_layernorm = RMSNorm(hf_config.hidden_size, eps, dtype)
        self.self_attn = LlamaAttention(hf_config, attn_backend, dtype, sliding_window)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, eps, dtype)
        act = getattr(hf_config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise NotImplementedError(f"hidden_act {act!r} is not supported by the Llama implementation (silu only)")
        self.mlp = GatedMLP(hf_config.hidden_size, hf_config.intermediate_size, dtype,
                            bool(getattr(hf_config, "mlp_bias", False)))
        self._ops = current_model_ops()
        self._native: Any = None  # the platform's whole-layer call (ModelOps.decoder_layer) or False; made on first use

    def fast_path_record(self) -> DecoderLayerRecord | str:
        """What a platform's fused path needs of this layer (``model_registry.layers.fast_path``), or why it has
        no such form (a model may swap a part: the EAGLE head's missing input norm)."""
        norms = (self.input_layernorm, self.post_attention_layernorm)
        if not all(type(n) is RMSNorm for n in norms):
            return "its norms are not both RMSNorm"
        attn, mlp = self.self_attn, self.mlp
        return DecoderLayerRecord(
            input_norm=NormRecord("rms", norms[0].weight, float(norms[0].eps)),
            post_attention_norm=NormRecord("rms", norms[1].weight, float(norms[1].eps)),
            qkv_proj=attn.qkv_proj, o_proj=attn.o_proj, gate_up_proj=mlp.gate_up_proj, down_proj=mlp.down_proj,
            attention=attn.attn, activation="silu", rope="neox", ops=self._ops)

    def native_layer(self) -> Any:
        """The platform's whole-layer call (ModelOps.decoder_layer), or None; made on first use, after loading,
        when the weights are the final ones (quantized, GGUF blocks)."""
        if self._native is None:
            self._native = self._ops.decoder_layer(self.fast_path_record()) or False
        return self._native or None

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor, attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer on (layer input, residual stream): the residual add is fused into the next norm.
        ``residual`` None means ``x`` is the embedding itself (the first layer)."""
        native = self.native_layer()
        if native:
            out = native(rope, x, residual, kv_cache, attn_metadata)
            if out is not None:
                return out
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn.forward(rope, h, kv_cache, attn_metadata)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp.forward(h), residual


class LlamaModel(nn.Module):
    """The embedding, the decoder layers, the final norm; with pipeline stages only this rank's part of them
    (``model_registry.layers.pipeline``): the embedding on the first stage, the norm on the last."""

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        num_layers = hf_config.num_hidden_layers
        self.stage = stage = StageLayers(num_layers)
        # This rank's block of token rows (the whole table on one rank).
        self.embed_tokens = (VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size, dtype)
                             if stage.is_first else None)
        head_size = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        self.rotary_emb = RotaryEmbedding(hf_config, head_size)
        windows = _layer_windows(hf_config, num_layers)
        self.layers = stage.build(num_layers, lambda i: LlamaDecoderLayer(hf_config, attn_backend, dtype, windows[i]))
        self.norm = (RMSNorm(hf_config.hidden_size, float(getattr(hf_config, "rms_norm_eps", 1e-6)), dtype)
                     if stage.is_last else None)
        self._ops = current_model_ops()
        self._native_stack: Any = None  # the platform's all-layers call (ModelOps.decoder_stack) or False: on first use

    @property
    def stage_layers(self) -> list[nn.Module]:
        """This rank's layers, in order (all of them without pipeline stages)."""
        return list(self.layers)[self.stage.start:self.stage.end]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: list[AttentionMetadata], inputs_embeds: torch.Tensor | None = None,
                intermediate: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        """Final hidden states, or on a stage before the last what the next stage continues from;
        ``intermediate``: what the previous stage handed this one."""
        if intermediate is None:
            x, residual = (self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds), None
        else:
            x, residual = intermediate.hidden_states, intermediate.residual
        rope = self.rotary_emb.lookup(positions, x.dtype)  # shared by every layer
        stack = self._native_stack
        if stack is None:  # after loading, as each layer's own call
            stack = self._native_stack = self._ops.decoder_stack(self.stage_layers) or False
        out = stack(rope, x, kv_caches, attn_metadata) if stack and residual is None else None
        if out is not None:  # the native stack starts from the embedding
            x, residual = out
        else:
            for layer, kv_cache, md in zip(self.stage_layers, kv_caches, attn_metadata, strict=True):
                x, residual = layer.forward(rope, x, residual, kv_cache, md)
        if not self.stage.is_last:
            return IntermediateTensors(x, residual)
        return self.norm(x) if residual is None else self.norm.add_forward(x, residual)[0]


_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class LlamaForCausalLM(nn.Module, SupportsLoRA, ShardsByHeads):
    """Engine model for LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM checkpoints."""

    # model_registry.layers.quantization
    supported_quantization = ("int8", "gguf", "compressed-tensors", "fp8", "gptq", "awq")

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = hf_config
        self.dtype = dtype
        self.model = self._build_model(hf_config, attn_backend, dtype)
        self.stage: StageLayers = self.model.stage
        attn = self.first_layer.self_attn
        self.num_layers: int = hf_config.num_hidden_layers
        self.num_heads: int = attn.num_heads
        self.num_kv_heads: int = attn.num_kv_heads
        self.head_size: int = attn.head_size
        self.hidden_size: int = hf_config.hidden_size
        self.vocab_size: int = hf_config.vocab_size
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        # On the last stage only; tied to the embedding when this stage also holds it, else its own copy of the
        # table (loaded from the embedding's tensor).
        tied = self.model.embed_tokens if self.tie_word_embeddings and self.stage.is_first else None
        self.lm_head = (ParallelLMHead(self.vocab_size, self.hidden_size, dtype, tied=tied)
                        if self.stage.is_last else None)

    # Pipeline stages (``pipeline_parallel_size``): every model built on LlamaModel / DenseModel builds only its
    # stage's layers (model_registry.layers.pipeline); vllite_core.distributed.checks reads this.
    supports_pipeline_parallel = True

    @property
    def first_layer(self) -> nn.Module:
        """The first layer this rank holds (every layer has the same shapes)."""
        return self.model.layers[self.stage.start]

    @classmethod
    def fused_cpu_path(cls, hf_config: Any) -> str | None:
        """Why the layers do not take the CPU platform's fused decoder layer, or None when they do (every
        Llama-family layer is the shape it computes)."""
        return None

    def _build_model(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> nn.Module:
        """The decoder stack (the dense families build theirs: ``model_registry.models.dense``)."""
        return LlamaModel(hf_config, attn_backend, dtype)

    def get_kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec]:
        """One self-attention cache per layer: sliding-window layers get their own group, whose blocks
        out of the window are released."""
        return [layer.self_attn.attn.kv_cache_spec(block_size, dtype) for layer in self.model.stage_layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: list[AttentionMetadata], inputs_embeds: torch.Tensor | None = None,
                intermediate: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        """Hidden states [T, hidden_size] for the flattened tokens of every request in the step (a multimodal
        wrapper passes ``inputs_embeds`` with image rows in place of their placeholders). With pipeline stages
        ``kv_caches`` are this stage's layers' and a stage before the last returns ``IntermediateTensors``."""
        if intermediate is None:
            return self.model(input_ids, positions, kv_caches, attn_metadata, inputs_embeds)
        return self.model(input_ids, positions, kv_caches, attn_metadata, inputs_embeds, intermediate)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] for the rows the sampler needs, in the model dtype as vLLM's are: the sampler widens
        them to float32 where it computes with them (a greedy-only batch just takes the argmax, and a float32
        copy of a batch-64 step's bf16 logits cost 0.6 ms)."""
        return self.lm_head(hidden_states)

    def ensure_positions(self, max_model_len: int) -> None:
        """Grow the RoPE tables to ``max_model_len`` positions (needed only beyond max_position_embeddings
        on accelerators; on the CPU the tables grow on demand)."""
        self.model.rotary_emb.ensure_positions(max_model_len)

    def lora_targets(self) -> dict[str, tuple[str, int, int]]:
        """SupportsLoRA: each HF projection name -> (the engine layer holding it, its output rows there)."""
        out: dict[str, tuple[str, int, int]] = {}
        down = self.first_layer.mlp.down_proj.local_features[0]
        for i in range(self.num_layers):
            pre = f"model.layers.{i}."
            for hf, fused, shard in STACKED_PROJECTIONS:
                part = "self_attn" if shard in "qkv" else "mlp"
                sl = self._shard_slice(shard)
                out[f"{pre}{part}{hf[:-1]}"] = (f"{pre}{part}{fused[:-1]}", sl.start, sl.stop)
            out[f"{pre}self_attn.o_proj"] = (f"{pre}self_attn.o_proj", 0, self.hidden_size)
            out[f"{pre}mlp.down_proj"] = (f"{pre}mlp.down_proj", 0, down)
        return out

    # ---- weights -------------------------------------------------------------------------------

    def _shard_slice(self, shard: str) -> slice:
        """Rows of a fused weight that hold one checkpoint tensor."""
        if shard in ("q", "k", "v"):
            attn = self.first_layer.self_attn
            start = {"q": 0, "k": attn.q_size, "v": attn.q_size + attn.kv_size}[shard]
            return slice(start, start + (attn.q_size if shard == "q" else attn.kv_size))
        size = self.first_layer.mlp.intermediate_size
        return slice(0, size) if shard == "gate" else slice(size, 2 * size)

    def _rename(self, hf_name: str) -> str | None:
        """A checkpoint name -> this model's (a base model's checkpoint has no ``model.`` prefix), or None for a
        tensor it does not keep (rotary tables; the head's copy when it is the embedding)."""
        if hf_name.endswith(_IGNORED_SUFFIXES):
            return None
        name = "model." + hf_name if hf_name.startswith(("layers.", "embed_tokens.", "norm.")) else hf_name
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return None
        # A pooling form has no head: the embedding's table is then the first stage's alone.
        return self.stage.weight_name(name, self.tie_word_embeddings and getattr(self, "lm_head", None) is not None)

    def skips_weight(self, hf_name: str) -> bool:
        """A checkpoint tensor this rank does not keep (another stage's, a rotary table): the loader does not
        read it."""
        return self._rename(hf_name) is None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into the (fused) parameters; returns the parameter names fully loaded. A float8
        cache's per-layer scales go to their attention layer."""
        attention = {name: m.attn for name, m in self.named_modules()
                     if name.endswith("self_attn") and isinstance(getattr(m, "attn", None), Attention)}

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for hf_name, tensor in weights:
                name = self._rename(hf_name)
                kv_scale = kv_scale_name(name) if name is not None else None
                if kv_scale is not None and kv_scale[0] in attention:
                    attention[kv_scale[0]].kv_scales.set_from_checkpoint(kv_scale[1], tensor, kv_scale[0])
                else:
                    yield hf_name, tensor  # elsewhere: no parameter of that name, so refused as unknown

        loaded = load_by_name(self, tensors(), self._rename, STACKED_PROJECTIONS)
        if self.tie_word_embeddings and self.stage.is_first and "model.embed_tokens.weight" in loaded:
            loaded.add("lm_head.weight")
        return loaded
