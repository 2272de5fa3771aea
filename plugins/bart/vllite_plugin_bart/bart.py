"""BART for the vllite engine (BartForConditionalGeneration checkpoints).

The encoder runs once per request, when the scheduler admits it (``encode``); each decoder
layer's cross-attention K/V of that output go to the engine's cross-attention blocks
(``cross_kv``). The decoder then runs like any decoder-only model: flattened tokens of every
request in the step, self-attention over the paged KV cache (``attn_backend.forward``), and
cross-attention over the request's encoder K/V (``attn_backend.forward_cross``).

BART specifics followed from transformers: learned positions with an offset of 2, embeddings
scaled by sqrt(d_model) when ``scale_embedding`` is set, a LayerNorm on the embeddings,
post-LN layers (residual, then LayerNorm), biased projections, the configured activation
(GELU for BART), ``final_logits_bias`` added to the logits. The encoder's and the decoder's
self-attention q/k/v projections are fused into one matmul, the cross-attention k/v into another.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model_registry.layers import TORCH_OPS, Embedding, LayerNorm, ParallelLMHead, VocabParallelEmbedding, get_act_fn
from vllite_core.attention.backend import AttentionBackend, AttentionMetadata
from vllite_core.core.kv_cache_spec import CrossAttentionSpec, FullAttentionSpec, KVCacheSpec
from vllite_core.errors import InvalidRequestError
from vllite_core.inputs import InputContext, ProcessedPrompt
from vllite_core.model_interfaces import SupportsEncoderDecoder
from vllite_plugin_bart.layers import cfg, linear, load_hf_weights, model_device

POSITION_OFFSET = 2  # BART's learned position table starts at row 2

# Checkpoint q/k/v (and cross k/v) projections -> the fused parameters.
STACKED = (
    (".self_attn.q_proj.", ".self_attn.qkv_proj.", 0, 3),
    (".self_attn.k_proj.", ".self_attn.qkv_proj.", 1, 3),
    (".self_attn.v_proj.", ".self_attn.qkv_proj.", 2, 3),
    (".encoder_attn.k_proj.", ".encoder_attn.kv_proj.", 0, 2),
    (".encoder_attn.v_proj.", ".encoder_attn.kv_proj.", 1, 2),
)


# ---- encoder -------------------------------------------------------------------------------------

class EncoderSelfAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.head_size = num_heads, dim // num_heads
        self.qkv_proj = linear(dim, 3 * dim, True, dtype)
        self.out_proj = linear(dim, dim, True, dtype)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv_proj(x).view(b, s, 3, self.num_heads, self.head_size).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_size ** -0.5)
        return self.out_proj(out.transpose(1, 2).reshape(b, s, d))


class BartEncoderLayer(nn.Module):
    def __init__(self, c: Any, dtype: torch.dtype) -> None:
        super().__init__()
        d = c.d_model
        self.self_attn = EncoderSelfAttention(d, c.encoder_attention_heads, dtype)
        self.self_attn_layer_norm = LayerNorm(d, dtype)
        self.fc1 = linear(d, c.encoder_ffn_dim, True, dtype)
        self.fc2 = linear(c.encoder_ffn_dim, d, True, dtype)
        self.final_layer_norm = LayerNorm(d, dtype)
        self.act = get_act_fn(c.activation_function)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = self.self_attn_layer_norm(x + self.self_attn(x, mask))
        return self.final_layer_norm(x + self.fc2(self.act(self.fc1(x))))


class BartEncoder(nn.Module):
    def __init__(self, c: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.max_positions = c.max_position_embeddings
        self.embed_positions = Embedding(c.max_position_embeddings + POSITION_OFFSET, c.d_model, dtype)
        self.layers = nn.ModuleList(BartEncoderLayer(c, dtype) for _ in range(c.encoder_layers))
        self.layernorm_embedding = LayerNorm(c.d_model, dtype)

    def forward(self, embeds: list[torch.Tensor]) -> list[torch.Tensor]:
        """Encoder outputs for a batch of input embeddings ([S_i, d] each, already scaled), padded
        into one batch whose padding keys are masked out."""
        lengths = [int(e.shape[0]) for e in embeds]
        longest = max(lengths)
        x = torch.nn.utils.rnn.pad_sequence(embeds, batch_first=True)  # [B, S, d]
        x = x + self.embed_positions.weight[POSITION_OFFSET:POSITION_OFFSET + longest]
        x = self.layernorm_embedding(x)
        mask = None
        if len(set(lengths)) > 1:
            keep = torch.arange(longest, device=x.device)[None, :] < torch.tensor(lengths, device=x.device)[:, None]
            mask = keep[:, None, None, :]  # [B, 1, 1, S]: True = attend
        for layer in self.layers:
            x = layer(x, mask)
        return [x[i, :n] for i, n in enumerate(lengths)]


# ---- decoder -------------------------------------------------------------------------------------

class DecoderSelfAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.head_size = num_heads, dim // num_heads
        self.scale = self.head_size ** -0.5
        self.qkv_proj = linear(dim, 3 * dim, True, dtype)
        self.out_proj = linear(dim, dim, True, dtype)
        self.attn_backend = attn_backend

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).view(t, 3, self.num_heads, self.head_size).unbind(1)
        out = self.attn_backend.forward(q, k, v, kv_cache, md, self.scale)
        return self.out_proj(out.reshape(t, -1))


class CrossAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.head_size = num_heads, dim // num_heads
        self.scale = self.head_size ** -0.5
        self.q_proj = linear(dim, dim, True, dtype)
        self.kv_proj = linear(dim, 2 * dim, True, dtype)
        self.out_proj = linear(dim, dim, True, dtype)
        self.attn_backend = attn_backend

    def encoder_kv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.kv_proj(h).view(h.shape[0], 2, self.num_heads, self.head_size).unbind(1)
        return k, v

    def forward(self, x: torch.Tensor, cross_cache: torch.Tensor, cross_md: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_size)
        out = self.attn_backend.forward_cross(q, cross_cache, cross_md, self.scale)
        return self.out_proj(out.reshape(t, -1))


class BartDecoderLayer(nn.Module):
    def __init__(self, c: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        d, h = c.d_model, c.decoder_attention_heads
        self.self_attn = DecoderSelfAttention(d, h, attn_backend, dtype)
        self.self_attn_layer_norm = LayerNorm(d, dtype)
        self.encoder_attn = CrossAttention(d, h, attn_backend, dtype)
        self.encoder_attn_layer_norm = LayerNorm(d, dtype)
        self.fc1 = linear(d, c.decoder_ffn_dim, True, dtype)
        self.fc2 = linear(c.decoder_ffn_dim, d, True, dtype)
        self.final_layer_norm = LayerNorm(d, dtype)
        self.act = get_act_fn(c.activation_function)

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata, cross_cache: torch.Tensor,
                cross_md: AttentionMetadata) -> torch.Tensor:
        x = self.self_attn_layer_norm(x + self.self_attn(x, kv_cache, md))
        x = self.encoder_attn_layer_norm(x + self.encoder_attn(x, cross_cache, cross_md))
        return self.final_layer_norm(x + self.fc2(self.act(self.fc1(x))))


class BartDecoder(nn.Module):
    def __init__(self, c: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_positions = Embedding(c.max_position_embeddings + POSITION_OFFSET, c.d_model, dtype)
        self.layers = nn.ModuleList(BartDecoderLayer(c, attn_backend, dtype) for _ in range(c.decoder_layers))
        self.layernorm_embedding = LayerNorm(c.d_model, dtype)


class BartModel(nn.Module):
    """transformers' BartModel layout (``shared``, ``encoder``, ``decoder``), so checkpoint names map 1:1.

    With ``tie_word_embeddings`` (the default) the encoder's and the decoder's token embeddings are
    ``shared`` itself; otherwise each has its own table, as in transformers.
    """

    def __init__(self, c: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = c
        self.embed_scale = float(c.d_model) ** 0.5 if cfg(c, "scale_embedding", False) else 1.0
        self.shared = VocabParallelEmbedding(c.vocab_size, c.d_model, dtype)
        self.encoder = BartEncoder(c, dtype)
        self.decoder = BartDecoder(c, attn_backend, dtype)
        tied = bool(cfg(c, "tie_word_embeddings", True))
        self.encoder.embed_tokens = self.shared if tied else VocabParallelEmbedding(c.vocab_size, c.d_model, dtype)
        self.decoder.embed_tokens = self.shared if tied else VocabParallelEmbedding(c.vocab_size, c.d_model, dtype)

    def embed_encoder_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.encoder.embed_tokens(ids) * self.embed_scale

    def kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec]:
        """Decoder self-attention caches (layers 0..L-1), then cross-attention caches (L..2L-1)."""
        c = self.config
        heads, head_size = c.decoder_attention_heads, c.d_model // c.decoder_attention_heads
        full = FullAttentionSpec(block_size, heads, head_size, dtype)
        cross = CrossAttentionSpec(block_size, heads, head_size, dtype, max_encoder_len=c.max_position_embeddings)
        return [full] * c.decoder_layers + [cross] * c.decoder_layers

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
               attn_metadata: list[AttentionMetadata]) -> torch.Tensor:
        """The decoder over ``kv_caches`` / ``attn_metadata`` laid out as ``kv_cache_specs`` says."""
        dec = self.decoder
        n = len(dec.layers)
        x = dec.embed_tokens(input_ids) * self.embed_scale + F.embedding(positions + POSITION_OFFSET,
                                                                         dec.embed_positions.weight)
        x = dec.layernorm_embedding(x)
        for i, layer in enumerate(dec.layers):
            x = layer(x, kv_caches[i], attn_metadata[i], kv_caches[n + i], attn_metadata[n + i])
        return x

    def cross_kv(self, encoder_hidden: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [layer.encoder_attn.encoder_kv(encoder_hidden) for layer in self.decoder.layers]


# ---- prompts -------------------------------------------------------------------------------------

_GENERATION_DEFAULTS: dict[str, tuple[Any, int, int | None]] = {}


def generation_defaults(ctx: InputContext, text_config: Any) -> tuple[int, int | None]:
    """(decoder_start_token_id, forced_bos_token_id) as transformers' ``generate`` would use them: from the
    folder's generation_config.json, else derived from the model config."""
    cached = _GENERATION_DEFAULTS.get(ctx.model_path)
    if cached is not None and cached[0] is ctx.hf_config:
        return cached[1], cached[2]
    from transformers import GenerationConfig

    try:
        gen = GenerationConfig.from_pretrained(ctx.model_path)
    except (OSError, ValueError):
        gen = GenerationConfig.from_model_config(ctx.hf_config)
    start = gen.decoder_start_token_id
    if start is None:
        start = getattr(text_config, "decoder_start_token_id", None)
    if start is None:
        start = gen.bos_token_id if gen.bos_token_id is not None else getattr(text_config, "bos_token_id", None)
    if start is None:
        raise InvalidRequestError("prompt", "the model config defines neither decoder_start_token_id nor "
                                  "bos_token_id: give a decoder_prompt")
    if isinstance(start, (list, tuple)):
        start = start[0]
    forced_bos = gen.forced_bos_token_id
    _GENERATION_DEFAULTS[ctx.model_path] = (ctx.hf_config, int(start), forced_bos)
    return int(start), forced_bos


def text_or_ids(prompt: Any, tokenizer: Any, field: str, add_special_tokens: bool) -> tuple[str | None, list[int]]:
    """A prompt given as text, token ids, ``{"prompt": text}`` or ``{"prompt_token_ids": [...]}``."""
    if isinstance(prompt, str):
        return prompt, list(tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
    if isinstance(prompt, (list, tuple)):
        ids = prompt
    elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
    elif isinstance(prompt, dict) and "prompt" in prompt:
        return text_or_ids(prompt["prompt"], tokenizer, field, add_special_tokens)
    else:
        raise InvalidRequestError(field, f"must be a string, a list of token ids, or a dict with 'prompt' or "
                                         f"'prompt_token_ids', got {type(prompt).__name__}")
    if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise InvalidRequestError(field, "token ids must be a list of integers")
    return (prompt.get("prompt") if isinstance(prompt, dict) else None), list(ids)


def decoder_prompt_ids(decoder_prompt: Any, ctx: InputContext, text_config: Any) -> list[int]:
    """The decoder's prompt: ``[decoder_start_token_id]`` (plus ``forced_bos_token_id`` when the generation
    config forces one, as transformers' ForcedBOS logits processor does at the first step), or a given
    decoder prompt, with the start token put in front when it does not begin with it."""
    start, forced_bos = generation_defaults(ctx, text_config)
    if decoder_prompt is None:
        return [start] if forced_bos is None else [start, int(forced_bos)]
    _, ids = text_or_ids(decoder_prompt, ctx.tokenizer, "decoder_prompt", add_special_tokens=False)
    return ids if ids and ids[0] == start else [start] + ids


def check_encoder_ids(ids: list[int], vocab_size: int, max_len: int, field: str = "prompt") -> None:
    if not ids:
        raise InvalidRequestError(field, "the encoder prompt is empty")
    if len(ids) > max_len:
        raise InvalidRequestError(field, f"the encoder prompt has {len(ids)} tokens, more than the encoder's "
                                         f"{max_len} positions")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(field, f"token id {bad[0]} is out of range [0, {vocab_size})")


# ---- the engine model ----------------------------------------------------------------------------

class BartForConditionalGeneration(nn.Module, SupportsEncoderDecoder):
    """Engine model for BartForConditionalGeneration checkpoints (text in, text out)."""

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        c = hf_config
        self.config = c
        self.model = BartModel(c, attn_backend, dtype)
        self.num_layers: int = c.decoder_layers
        self.num_kv_heads: int = c.decoder_attention_heads
        self.head_size: int = c.d_model // c.decoder_attention_heads
        self.vocab_size: int = c.vocab_size
        self.max_encoder_len: int = c.max_position_embeddings
        self.tie_word_embeddings = bool(cfg(c, "tie_word_embeddings", True))
        self.lm_head = ParallelLMHead(c.vocab_size, c.d_model, dtype,
                                      tied=self.model.shared if self.tie_word_embeddings else None, ops=TORCH_OPS)
        self.register_buffer("final_logits_bias", torch.zeros(1, c.vocab_size, dtype=torch.float32))

    # ---- the core's encoder-decoder contract ----------------------------------------------------
    @classmethod
    def get_max_model_len(cls, hf_config: Any) -> int:
        return int(hf_config.max_position_embeddings)

    @classmethod
    def process_prompt(cls, prompt: Any, ctx: InputContext) -> ProcessedPrompt:
        """A string (or ``{"prompt": ...}`` / ``{"prompt_token_ids": [...]}``) is the encoder's input, tokenized
        with the tokenizer's special tokens. ``{"encoder_prompt": ..., "decoder_prompt": ...}`` also sets the
        decoder's prompt; by default it is what transformers' ``generate`` starts from."""
        c = ctx.hf_config
        if isinstance(prompt, dict) and ("encoder_prompt" in prompt or "decoder_prompt" in prompt):
            if prompt.get("encoder_prompt") is None:
                raise InvalidRequestError("encoder_prompt", "an encoder-decoder prompt needs an encoder_prompt")
            enc, dec = prompt["encoder_prompt"], prompt.get("decoder_prompt")
        else:
            enc, dec = prompt, None
        text, ids = text_or_ids(enc, ctx.tokenizer, "prompt", add_special_tokens=True)
        check_encoder_ids(ids, c.vocab_size, c.max_position_embeddings)
        return ProcessedPrompt(prompt_token_ids=decoder_prompt_ids(dec, ctx, c), prompt=text,
                               encoder_inputs=ids, num_encoder_tokens=len(ids))

    def encode(self, encoder_inputs: list[list[int]]) -> list[torch.Tensor]:
        dev = model_device(self)
        embeds = [self.model.embed_encoder_tokens(torch.as_tensor(ids, dtype=torch.long, device=dev))
                  for ids in encoder_inputs]
        return self.model.encoder(embeds)

    def cross_kv(self, encoder_hidden: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.model.cross_kv(encoder_hidden)

    def get_kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec]:
        return self.model.kv_cache_specs(block_size, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: list[AttentionMetadata]) -> torch.Tensor:
        return self.model.decode(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states).float() + self.final_logits_bias

    # ---- weights --------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def rename(name: str) -> str | None:
            if name.endswith((".version", "embed_positions._float_tensor")):
                return None  # fairseq leftovers some checkpoints carry
            if name == "lm_head.weight" and self.tie_word_embeddings:
                return None  # the head is the shared embedding
            if not name.startswith(("model.", "lm_head.", "final_logits_bias")):
                name = "model." + name  # a BartModel checkpoint (no "model." prefix)
            return name

        loaded = load_hf_weights(self, weights, rename=rename, stacked=STACKED, buffers=("final_logits_bias",))
        return loaded
