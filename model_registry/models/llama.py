"""The Llama family (Llama, Mistral, Qwen2) written for the engine.

Tokens of all requests arrive flattened ([T], no padding) with their positions;
attention goes through the platform's ``AttentionBackend`` over a paged KV
cache. q/k/v and gate/up projections are fused into one matmul each; HF
checkpoint names are mapped onto the fused weights in ``load_weights``.
Differences inside the family are config switches: Qwen2 has q/k/v bias (and
optional per-layer sliding windows), Mistral may have a sliding window.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from model_registry.models.rope import RotaryEmbedding
from model_registry.parallel_layers import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    gather_logits,
    load_parameter,
    vocab_embedding,
    vocab_parameter,
)
from vllite_core.attention.backend import AttentionBackend, AttentionMetadata
from vllite_core.attention.kv_quant import KVScales, kv_scale_name
from vllite_core.core.kv_cache_spec import KVCacheSpec, attention_specs
from vllite_core.distributed.sharding import check_heads
from vllite_core.model_interfaces import SupportsLoRA, SupportsTensorParallel
from vllite_core.model_ops import current_model_ops


class Linear(nn.Module):
    """y = x W^T + b with uninitialised storage: every weight comes from the checkpoint, so no init cost."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self._ops = current_model_ops()
        self._state: dict = {}
        self.lora = None  # a vllite_core.lora.slots.LoRALayer when the engine serves adapters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._ops.linear(x, self.weight, self.bias, self._state)
        return y if self.lora is None else self.lora(x, y)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, cast back, then scaled (transformers' order, for matching numerics)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self._ops = current_model_ops()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._ops.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + x), residual + x)``; may reuse both inputs' storage."""
        return self._ops.add_rms_norm(x, residual, self.weight, self.eps)


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
        self.scale = self.head_size ** -0.5
        self.sliding_window = sliding_window
        q_cols = (heads.q_start * self.head_size, heads.q_start * self.head_size + self.q_size)
        self.o_proj = RowParallelLinear(num_heads * self.head_size, c.hidden_size, o_bias, dtype, q_cols)
        self.attn_backend = attn_backend
        self.kv_scales = KVScales()  # float8 caches only: the checkpoint's, 1.0, or the first batch's
        self._ops = current_model_ops()

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        # Children are called through .forward (no module hooks): a decode step makes ~9 such calls per
        # layer, and nn.Module.__call__ costs about a microsecond each. One view and one split give the
        # heads (three splits and three views cost twice that).
        q, k, v = self.qkv_proj.forward(x).view(t, -1, self.head_size).split_with_sizes(self._head_split, 1)
        q, k = self._ops.rotary(q, k, *rope)
        self.kv_scales.maybe_calculate(k, v, kv_cache)
        out = self.attn_backend.forward(q, k, v, kv_cache, attn_metadata, self.scale, self.sliding_window,
                                        **self.kv_scales.kwargs())
        return self.o_proj.forward(out.reshape(t, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        act = getattr(hf_config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise NotImplementedError(f"hidden_act {act!r} is not supported by the Llama implementation (silu only)")
        bias = bool(getattr(hf_config, "mlp_bias", False))
        size = hf_config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hf_config.hidden_size, {"gate": size, "up": size}, bias,
                                                       dtype)
        self.intermediate_size = self.gate_up_proj.segments["gate"].length  # this rank's part
        self.down_proj = RowParallelLinear(size, hf_config.hidden_size, bias, dtype)
        self._ops = current_model_ops()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(self._ops.silu_and_mul(self.gate_up_proj.forward(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype,
                 sliding_window: int | None) -> None:
        super().__init__()
        eps = float(getattr(hf_config, "rms_norm_eps", 1e-6))
        self.input_layernorm = RMSNorm(hf_config.hidden_size, eps, dtype)
        self.self_attn = LlamaAttention(hf_config, attn_backend, dtype, sliding_window)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, eps, dtype)
        self.mlp = LlamaMLP(hf_config, dtype)
        self._ops = current_model_ops()
        self._native: Any = None  # the platform's whole-layer call (ModelOps.decoder_layer) or False; made on first use

    def _standard_parts(self) -> bool:
        """The parts ModelOps.decoder_layer expects (a model may swap one: the EAGLE head's missing input norm)."""
        return (type(self.input_layernorm) is RMSNorm and type(self.post_attention_layernorm) is RMSNorm
                and type(self.self_attn) is LlamaAttention and type(self.mlp) is LlamaMLP)

    def native_layer(self) -> Any:
        """The platform's whole-layer call (ModelOps.decoder_layer), or None; made on first use, after loading,
        when the weights are the final ones (quantized, GGUF blocks)."""
        if self._native is None:
            self._native = self._standard_parts() and self._ops.decoder_layer(self) or False
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
    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        # This rank's block of token rows (the whole table on one rank).
        self.embed_tokens, self.vocab_shard = vocab_parameter(hf_config.vocab_size, hf_config.hidden_size, dtype)
        num_layers = hf_config.num_hidden_layers
        head_size = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        self.rotary_emb = RotaryEmbedding(hf_config, head_size)
        windows = _layer_windows(hf_config, num_layers)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(hf_config, attn_backend, dtype, windows[i]) for i in range(num_layers))
        self.norm = RMSNorm(hf_config.hidden_size, float(getattr(hf_config, "rms_norm_eps", 1e-6)), dtype)
        self._ops = current_model_ops()
        self._native_stack: Any = None  # the platform's all-layers call (ModelOps.decoder_stack) or False: on first use

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: list[AttentionMetadata], inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        x = vocab_embedding(input_ids, self.embed_tokens, self.vocab_shard) if inputs_embeds is None else inputs_embeds
        rope = self.rotary_emb.lookup(positions, x.dtype)  # shared by every layer
        stack = self._native_stack
        if stack is None:  # after loading, as each layer's own call
            stack = self._native_stack = self._ops.decoder_stack(list(self.layers)) or False
        if stack:
            out = stack(rope, x, kv_caches, attn_metadata)
            if out is not None:
                return self.norm.add_forward(out[0], out[1])[0]
        residual = None
        for layer, kv_cache, md in zip(self.layers, kv_caches, attn_metadata, strict=True):
            x, residual = layer.forward(rope, x, residual, kv_cache, md)
        return self.norm(x) if residual is None else self.norm.add_forward(x, residual)[0]


# HF checkpoint name fragment -> (fused parameter fragment, shard).
_STACKED = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", "gate"),
    (".up_proj.", ".gate_up_proj.", "up"),
)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class LlamaForCausalLM(nn.Module, SupportsLoRA, SupportsTensorParallel):
    """Engine model for LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM checkpoints."""

    supported_quantization = ("int8", "gguf")  # vllite_core.quantization

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = hf_config
        self.dtype = dtype
        self.model = LlamaModel(hf_config, attn_backend, dtype)
        attn = self.model.layers[0].self_attn
        self.num_layers: int = hf_config.num_hidden_layers
        self.num_heads: int = attn.num_heads
        self.num_kv_heads: int = attn.num_kv_heads
        self.head_size: int = attn.head_size
        self.hidden_size: int = hf_config.hidden_size
        self.vocab_size: int = hf_config.vocab_size
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self._ops = current_model_ops()
        self._head_state: dict = {}
        self.gguf_head = None  # the LM head's GGUF blocks under quantization="gguf" (model_registry.gguf_blocks)
        self.int8_head: tuple[torch.Tensor, torch.Tensor] | None = None  # (int8 rows, scales): quantize_lm_head_int8
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = vocab_parameter(self.vocab_size, self.hidden_size, dtype)[0]

    @classmethod
    def check_tensor_parallel(cls, hf_config: Any, tensor_parallel_size: int) -> None:
        """SupportsTensorParallel: ConfigError when the heads cannot be split over the ranks."""
        heads = hf_config.num_attention_heads
        check_heads(heads, getattr(hf_config, "num_key_value_heads", None) or heads, tensor_parallel_size)

    def get_kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec]:
        """One self-attention cache per layer: sliding-window layers get their own group, whose blocks
        out of the window are released."""
        windows = [layer.self_attn.sliding_window for layer in self.model.layers]
        return attention_specs(self.num_layers, block_size, self.num_kv_heads, self.head_size, dtype, windows)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: list[AttentionMetadata], inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [T, hidden_size] for the flattened tokens of every request in the step (a multimodal
        wrapper passes ``inputs_embeds`` with image rows in place of their placeholders)."""
        return self.model(input_ids, positions, kv_caches, attn_metadata, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return vocab_embedding(input_ids, self.model.embed_tokens, self.model.vocab_shard)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] for the rows the sampler needs, in the model dtype as vLLM's are: the sampler widens
        them to float32 where it computes with them (a greedy-only batch just takes the argmax, and a float32
        copy of a batch-64 step's bf16 logits cost 0.6 ms)."""
        if self.gguf_head is not None:
            local = self._ops.gguf_linear(hidden_states, self.gguf_head, None, self._head_state)
        elif self.int8_head is not None:
            local = self._ops.int8_linear(hidden_states, *self.int8_head, None, self._head_state)
        else:
            local = self._ops.linear(hidden_states, self.lm_head, None, self._head_state)
        return gather_logits(local, self.model.vocab_shard)

    def quantize_lm_head_int8(self) -> None:
        """``quantization="int8"`` with ``VLLITE_INT8_LM_HEAD=1``: logits from an int8 copy of this rank's LM head
        rows (a tied embedding stays as it is for the lookup)."""
        from vllite_core.quantization import quantize_rows_int8

        self.int8_head = quantize_rows_int8(self.lm_head.detach())
        self._head_state = {}

    def ensure_positions(self, max_model_len: int) -> None:
        """Grow the RoPE tables to ``max_model_len`` positions (needed only beyond max_position_embeddings
        on accelerators; on the CPU the tables grow on demand)."""
        self.model.rotary_emb.ensure_positions(max_model_len)

    def lora_targets(self) -> dict[str, tuple[str, int, int]]:
        """SupportsLoRA: each HF projection name -> (the engine layer holding it, its output rows there)."""
        out: dict[str, tuple[str, int, int]] = {}
        down = self.model.layers[0].mlp.down_proj.local_features[0]
        for i in range(self.num_layers):
            pre = f"model.layers.{i}."
            for hf, fused, shard in _STACKED:
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
            attn = self.model.layers[0].self_attn
            start = {"q": 0, "k": attn.q_size, "v": attn.q_size + attn.kv_size}[shard]
            return slice(start, start + (attn.q_size if shard == "q" else attn.kv_size))
        size = self.model.layers[0].mlp.intermediate_size
        return slice(0, size) if shard == "gate" else slice(size, 2 * size)

    @staticmethod
    def _canonical(name: str) -> str:
        if name.startswith(("layers.", "embed_tokens.", "norm.")):
            name = "model." + name
        return name.replace("model.embed_tokens.weight", "model.embed_tokens").replace("lm_head.weight", "lm_head")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into the (fused) parameters; returns the parameter names fully loaded."""
        params = dict(self.named_parameters(remove_duplicate=False))
        shards_needed = {".qkv_proj.": {"q", "k", "v"}, ".gate_up_proj.": {"gate", "up"}}
        shards_seen: dict[str, set[str]] = {}
        loaded: set[str] = set()
        unexpected: list[str] = []
        for hf_name, tensor in weights:
            if hf_name.endswith(_IGNORED_SUFFIXES):
                continue
            name = self._canonical(hf_name)
            if name == "lm_head" and self.tie_word_embeddings:
                continue  # tied: the embedding is the head
            if (kv_scale := kv_scale_name(name)) is not None:  # a float8 cache's per-layer scales
                attn = dict(self.named_modules()).get(kv_scale[0])
                if not isinstance(attn, LlamaAttention):
                    unexpected.append(hf_name)
                    continue
                attn.kv_scales.set_from_checkpoint(kv_scale[1], tensor, kv_scale[0])
                continue
            stacked = next(((name.replace(frag, fused), fused, shard) for frag, fused, shard in _STACKED
                            if frag in name), None)
            target = stacked[0] if stacked else name
            if target not in params:
                unexpected.append(hf_name)
                continue
            if stacked is None:
                load_parameter(params[target], tensor, None, hf_name)
                loaded.add(target)
                continue
            _, fused, shard = stacked
            load_parameter(params[target], tensor, shard, hf_name)
            seen = shards_seen.setdefault(target, set())
            seen.add(shard)
            if seen == shards_needed[fused]:
                loaded.add(target)
        if unexpected:
            shown = ", ".join(unexpected[:8]) + (" ..." if len(unexpected) > 8 else "")
            raise ValueError(f"checkpoint has weights this model does not know: {shown}")
        if self.tie_word_embeddings and "model.embed_tokens" in loaded:
            loaded.add("lm_head")
        return loaded


@torch.no_grad()
def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"weight {name}: checkpoint shape {tuple(src.shape)} does not match the model's "
                         f"{tuple(dst.shape)}")
    dst.copy_(src)
