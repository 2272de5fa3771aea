"""Whisper (WhisperForConditionalGeneration) written for the engine.

Audio in, text out. The prompt processor turns audio into log-mel features with
transformers' ``WhisperFeatureExtractor`` (padded to the model's 30 s window)
and builds the decoder prompt ``<|startoftranscript|><|lang|><|task|>
<|notimestamps|>``. The engine runs the encoder once per request when it is
admitted (``encode``), stores each decoder layer's cross-attention K/V in the
cross-attention block pool (``cross_kv``), then the decoder runs like any other
model: flattened tokens, paged causal self-attention through the platform's
``AttentionBackend.forward`` and cross-attention through ``forward_cross``.

Layout (matching Hugging Face names, so checkpoints load as they are):
- encoder: conv1 (k=3) + GELU, conv2 (k=3, stride 2) + GELU, + positions
  (sinusoidal, stored in the checkpoint), pre-LN layers (self-attention, GELU
  MLP), final LayerNorm;
- decoder: token + learned position embeddings, pre-LN layers (causal
  self-attention, cross-attention, GELU MLP), final LayerNorm; logits from the
  token embedding (tied) unless the config unties them.
k_proj has no bias in Whisper; q is scaled before the product, as the original.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from model_registry.layers import (
    TORCH_OPS,
    ColumnParallelLinear,
    Conv1d,
    Embedding,
    LayerNorm,
    ReplicatedLinear,
    RowParallelLinear,
    load_parameter,
)
from vllite_core.attention.backend import AttentionBackend, AttentionMetadata
from vllite_core.core.kv_cache_spec import CrossAttentionSpec, FullAttentionSpec, KVCacheSpec
from vllite_core.distributed import get_tp
from vllite_core.distributed.sharding import check_heads, shard_heads
from vllite_core.inputs import InputContext, ProcessedPrompt
from vllite_core.model_interfaces import SupportsEncoderDecoder, SupportsTensorParallel, SupportsTranscription

logger = logging.getLogger("vllite.model_registry")

SOT, EOT = "<|startoftranscript|>", "<|endoftext|>"
NO_TIMESTAMPS, START_OF_PREV = "<|notimestamps|>", "<|startofprev|>"
TASKS = ("transcribe", "translate")
_ENCODER_BATCH = 16  # encoder inputs run together per forward (bounds the activation memory)


# ---- layers (model_registry.layers; Whisper's matmuls stay plain F.linear: TORCH_OPS) ----------------
class Attention(nn.Module):
    """q/k/v/out projections (k without bias); how attention is computed is up to the caller. Under
    tensor parallelism a rank holds some heads: q/k/v column-parallel, out row-parallel."""

    def __init__(self, dim: int, num_heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        tp = get_tp()
        self.head_dim = dim // num_heads
        heads = shard_heads(num_heads, num_heads, tp.world_size, tp.rank)
        self.num_heads = heads.num_heads
        self.scaling = self.head_dim ** -0.5
        cols = (heads.q_start * self.head_dim, (heads.q_start + heads.num_heads) * self.head_dim)
        self.q_proj = ColumnParallelLinear(dim, dim, True, dtype, ops=TORCH_OPS, out_range=cols)
        self.k_proj = ColumnParallelLinear(dim, dim, False, dtype, ops=TORCH_OPS, out_range=cols)
        self.v_proj = ColumnParallelLinear(dim, dim, True, dtype, ops=TORCH_OPS, out_range=cols)
        self.out_proj = RowParallelLinear(dim, dim, True, dtype, in_range=cols, ops=TORCH_OPS)

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """Scaled queries [..., H, D] (scaled before the product, as Whisper does)."""
        return (self.q_proj(x) * self.scaling).unflatten(-1, (self.num_heads, self.head_dim))

    def key_value(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.num_heads, self.head_dim)
        return self.k_proj(x).unflatten(-1, shape), self.v_proj(x).unflatten(-1, shape)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        d = cfg.d_model
        self.self_attn = Attention(d, cfg.encoder_attention_heads, dtype)
        self.self_attn_layer_norm = LayerNorm(d, dtype)
        self.fc1 = ColumnParallelLinear(d, cfg.encoder_ffn_dim, True, dtype, ops=TORCH_OPS)
        self.fc2 = RowParallelLinear(cfg.encoder_ffn_dim, d, True, dtype, ops=TORCH_OPS)
        self.final_layer_norm = LayerNorm(d, dtype)

    def forward(self, h: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[B, S, d], full (bidirectional) attention; ``attn_mask`` (bool, [B, 1, 1, S]) hides padding keys."""
        x = self.self_attn_layer_norm(h)
        q = self.self_attn.query(x).transpose(1, 2)
        k, v = (t.transpose(1, 2) for t in self.self_attn.key_value(x))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=1.0).transpose(1, 2).flatten(-2)
        h = h + self.self_attn.out_proj(o)
        x = self.final_layer_norm(h)
        h = h + self.fc2(F.gelu(self.fc1(x)))
        if h.dtype == torch.float16:  # as the original: keep fp16 activations finite
            lim = torch.finfo(h.dtype).max - 1000
            h = h.clamp(-lim, lim)
        return h


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        d = cfg.d_model
        self.attn_backend = attn_backend
        self.self_attn = Attention(d, cfg.decoder_attention_heads, dtype)
        self.self_attn_layer_norm = LayerNorm(d, dtype)
        self.encoder_attn = Attention(d, cfg.decoder_attention_heads, dtype)
        self.encoder_attn_layer_norm = LayerNorm(d, dtype)
        self.fc1 = ColumnParallelLinear(d, cfg.decoder_ffn_dim, True, dtype, ops=TORCH_OPS)
        self.fc2 = RowParallelLinear(cfg.decoder_ffn_dim, d, True, dtype, ops=TORCH_OPS)
        self.final_layer_norm = LayerNorm(d, dtype)

    def forward(self, h: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata,
                cross_cache: torch.Tensor, cross_md: AttentionMetadata) -> torch.Tensor:
        x = self.self_attn_layer_norm(h)
        q = self.self_attn.query(x)
        k, v = self.self_attn.key_value(x)
        o = self.attn_backend.forward(q, k, v, kv_cache, md, 1.0)
        h = h + self.self_attn.out_proj(o.flatten(-2))
        x = self.encoder_attn_layer_norm(h)
        o = self.attn_backend.forward_cross(self.encoder_attn.query(x), cross_cache, cross_md, 1.0)
        h = h + self.encoder_attn.out_proj(o.flatten(-2))
        x = self.final_layer_norm(h)
        return h + self.fc2(F.gelu(self.fc1(x)))


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Whisper's encoder position table (what checkpoints store as ``encoder.embed_positions``)."""
    inc = math.log(max_timescale) / (channels // 2 - 1)
    inv = torch.exp(-inc * torch.arange(channels // 2, dtype=torch.float32))
    t = torch.arange(length, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat([t.sin(), t.cos()], dim=1)


class WhisperEncoder(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        d = cfg.d_model
        self.conv1 = Conv1d(cfg.num_mel_bins, d, 3, dtype, stride=1, padding=1)
        self.conv2 = Conv1d(d, d, 3, dtype, stride=2, padding=1)
        self.embed_positions = Embedding(cfg.max_source_positions, d, dtype)
        self.layers = nn.ModuleList(EncoderLayer(cfg, dtype) for _ in range(cfg.encoder_layers))
        self.layer_norm = LayerNorm(d, dtype)

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # [B, mels, frames] -> [B, S, d]
        h = F.gelu(self.conv1(features))
        h = F.gelu(self.conv2(h)).transpose(1, 2)
        s = h.shape[1]
        if s > self.embed_positions.num_embeddings:
            raise ValueError(f"encoder input gives {s} positions, more than the model's "
                             f"{self.embed_positions.num_embeddings}")
        h = h + self.embed_positions.weight[:s]
        for layer in self.layers:
            h = layer(h)
        return self.layer_norm(h)


class WhisperDecoder(nn.Module):
    def __init__(self, cfg: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.d_model, dtype)  # the whole vocabulary on every rank
        self.embed_positions = Embedding(cfg.max_target_positions, cfg.d_model, dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, attn_backend, dtype) for _ in range(cfg.decoder_layers))
        self.layer_norm = LayerNorm(cfg.d_model, dtype)


# ---- the model --------------------------------------------------------------------------
class WhisperForConditionalGeneration(nn.Module, SupportsEncoderDecoder, SupportsTranscription,
                                      SupportsTensorParallel):

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        cfg = hf_config
        if cfg.d_model % cfg.decoder_attention_heads:
            raise ValueError(f"d_model={cfg.d_model} is not divisible by decoder_attention_heads="
                             f"{cfg.decoder_attention_heads}")
        self.config = cfg
        self.dtype = dtype
        self.num_layers = cfg.decoder_layers
        # No GQA: self- and cross-attention share the shape (this rank's heads under tensor parallelism).
        tp = get_tp()
        self.num_kv_heads = shard_heads(cfg.decoder_attention_heads, cfg.decoder_attention_heads, tp.world_size,
                                        tp.rank).num_heads
        self.head_size = cfg.d_model // cfg.decoder_attention_heads
        self.max_encoder_len = int(cfg.max_source_positions)
        self.vocab_size = int(cfg.vocab_size)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", True))
        self.model = nn.Module()
        self.model.encoder = WhisperEncoder(cfg, dtype)
        self.model.decoder = WhisperDecoder(cfg, attn_backend, dtype)
        if not self.tie_word_embeddings:
            self.proj_out = ReplicatedLinear(cfg.d_model, cfg.vocab_size, False, dtype, ops=TORCH_OPS)
        # Checkpoints store the sinusoidal table; fill it anyway so one that leaves it out still works.
        with torch.no_grad():
            self.model.encoder.embed_positions.weight.copy_(sinusoids(cfg.max_source_positions, cfg.d_model))

    # ---- engine contract --------------------------------------------------------------------
    @classmethod
    def check_tensor_parallel(cls, hf_config: Any, tensor_parallel_size: int) -> None:
        """SupportsTensorParallel: heads split whole over ranks (the vocabulary stays on every rank)."""
        for heads in (hf_config.encoder_attention_heads, hf_config.decoder_attention_heads):
            check_heads(heads, heads, tensor_parallel_size)

    @classmethod
    def get_max_model_len(cls, hf_config: Any) -> int:
        """The decoder's positions (the encoder's are a separate, fixed window)."""
        return int(hf_config.max_target_positions)

    @classmethod
    def process_prompt(cls, prompt: Any, ctx: InputContext) -> ProcessedPrompt:
        return process_whisper_prompt(prompt, ctx)

    # ---- transcription contract (LLM.transcribe, /v1/audio/transcriptions) ------------------
    @classmethod
    def max_audio_seconds(cls, ctx: InputContext) -> float:
        """Audio one request takes; longer audio is split into windows of this length."""
        return whisper_window_seconds(ctx)

    @classmethod
    def language_detection_prompt(cls, ctx: InputContext) -> tuple[list[int], dict[int, str]]:
        """Decoder ids to sample one language token from, and the language token ids -> codes
        (empty for English-only models)."""
        from transformers.models.whisper.tokenization_whisper import LANGUAGES

        tok = ctx.tokenizer
        langs = {tid: code for code in LANGUAGES if (tid := _token_id(tok, f"<|{code}|>")) is not None}
        return [_token_id(tok, SOT)], langs

    @torch.inference_mode()
    def encode(self, encoder_inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Log-mel features ([mels, frames] each) -> encoder output [S, d] each, batched by shape."""
        enc = self.model.encoder
        device = enc.conv1.weight.device
        out: list[torch.Tensor | None] = [None] * len(encoder_inputs)
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i, x in enumerate(encoder_inputs):
            by_shape.setdefault(tuple(x.shape), []).append(i)
        for idx in by_shape.values():
            for j in range(0, len(idx), _ENCODER_BATCH):
                part = idx[j:j + _ENCODER_BATCH]
                x = torch.stack([torch.as_tensor(encoder_inputs[i]) for i in part]).to(device, self.dtype)
                h = enc(x)
                for i, hi in zip(part, h):
                    out[i] = hi
        return out  # type: ignore[return-value]

    def cross_kv(self, encoder_hidden: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each decoder layer's cross-attention K/V ([S, H, D] each) from one encoder output."""
        return [layer.encoder_attn.key_value(encoder_hidden) for layer in self.model.decoder.layers]

    def get_kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec]:
        """Decoder self-attention caches (layers 0..L-1), then the cross-attention caches (L..2L-1)."""
        full = FullAttentionSpec(block_size, self.num_kv_heads, self.head_size, dtype)
        cross = CrossAttentionSpec(block_size, self.num_kv_heads, self.head_size, dtype,
                                   max_encoder_len=self.max_encoder_len)
        return [full] * self.num_layers + [cross] * self.num_layers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: list[AttentionMetadata]) -> torch.Tensor:
        dec = self.model.decoder
        n = self.num_layers
        h = dec.embed_tokens(input_ids) + dec.embed_positions(positions)
        for i, layer in enumerate(dec.layers):
            h = layer(h, kv_caches[i], attn_metadata[i], kv_caches[n + i], attn_metadata[n + i])
        return dec.layer_norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.model.decoder.embed_tokens.weight if self.tie_word_embeddings else self.proj_out.weight
        return F.linear(hidden, w).float()

    # ---- weights ----------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors (``model.encoder...``, ``model.decoder...``, ``proj_out``) in."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in weights:
            if name.startswith(("encoder.", "decoder.")):  # a bare WhisperModel checkpoint
                name = "model." + name
            if name == "proj_out.weight" and self.tie_word_embeddings:
                continue  # tied: the token embedding is the head
            target = params.get(name)
            if target is None:
                unexpected.append(name)
                continue
            load_parameter(target, tensor.to(target.dtype), None, name)  # this rank's slice of a sharded one
            loaded.add(name)
        if unexpected:
            shown = ", ".join(unexpected[:8]) + (" ..." if len(unexpected) > 8 else "")
            raise ValueError(f"checkpoint has weights this model does not know: {shown}")
        loaded.add("model.encoder.embed_positions.weight")  # sinusoids when the checkpoint leaves them out
        return loaded


# ---- prompts ----------------------------------------------------------------------------
def _feature_extractor(ctx: InputContext) -> Any:
    """The folder's feature extractor (preprocessor_config.json), else one built from the config."""
    if "whisper_feature_extractor" not in ctx._cache:
        fe = None
        try:
            fe = ctx.processor("feature_extractor")
        except Exception as e:  # no preprocessor_config.json
            logger.info("no feature extractor in %s (%s); building one from the model config", ctx.model_path, e)
        if fe is None or not hasattr(fe, "nb_max_frames"):
            from transformers import WhisperFeatureExtractor

            cfg = ctx.hf_config
            hop, sr = 160, 16000
            frames = 2 * int(cfg.max_source_positions)
            fe = WhisperFeatureExtractor(feature_size=cfg.num_mel_bins, sampling_rate=sr, hop_length=hop,
                                         chunk_length=frames * hop // sr)
        ctx._cache["whisper_feature_extractor"] = fe
    return ctx._cache["whisper_feature_extractor"]


def whisper_window_seconds(ctx: InputContext) -> float:
    """How many seconds of audio one request takes (30 s for the released models)."""
    fe = _feature_extractor(ctx)
    return fe.n_samples / fe.sampling_rate


def _audio_array(audio: Any, target_sr: int) -> np.ndarray:
    from vllite_core.audio import resample

    sr = target_sr
    if isinstance(audio, (tuple, list)) and len(audio) == 2 and np.isscalar(audio[1]):
        audio, sr = audio
    if isinstance(audio, torch.Tensor):
        audio = audio.detach().cpu().numpy()
    arr = np.asarray(audio)
    if arr.ndim != 1:
        raise ValueError(f"audio must be one channel (a 1-D array), got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError("audio is empty")
    if not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"audio must be float samples in [-1, 1], got dtype {arr.dtype}")
    arr = arr.astype(np.float32, copy=False)
    if int(sr) != target_sr:
        arr = resample(arr, int(sr), target_sr)
    return arr


def _token_id(tokenizer: Any, token: str) -> int | None:
    tid = tokenizer.convert_tokens_to_ids(token)
    if tid is None or (tid == tokenizer.unk_token_id and token != tokenizer.unk_token):
        return None
    return int(tid)


def language_code(language: str) -> str:
    """'en' or 'english' -> 'en' (Whisper's language table)."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES, TO_LANGUAGE_CODE

    lang = language.strip().lower()
    if lang in LANGUAGES:
        return lang
    if lang in TO_LANGUAGE_CODE:
        return TO_LANGUAGE_CODE[lang]
    raise ValueError(f"language {language!r} is not one Whisper knows (e.g. 'en', 'de', 'french')")


def decoder_prefix(tokenizer: Any, language: str | None = "en", task: str = "transcribe",
                   timestamps: bool = False) -> list[int]:
    """<|startoftranscript|>[<|lang|><|task|>][<|notimestamps|>]; English-only models have no language
    or task tokens, so those are left out for them."""
    sot = _token_id(tokenizer, SOT)
    if sot is None:
        raise ValueError(f"the tokenizer has no {SOT} token: not a Whisper tokenizer")
    ids = [sot]
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    multilingual = _token_id(tokenizer, "<|en|>") is not None
    if multilingual:
        if language is not None:
            lang = _token_id(tokenizer, f"<|{language_code(language)}|>")
            if lang is None:
                raise ValueError(f"this model's tokenizer has no token for language {language!r}")
            ids.append(lang)
        ids.append(_token_id(tokenizer, f"<|{task}|>"))
    elif task != "transcribe" or (language is not None and language_code(language) != "en"):
        raise ValueError("this is an English-only Whisper model: it transcribes English only")
    if not timestamps:
        ids.append(_token_id(tokenizer, NO_TIMESTAMPS))
    if any(t is None for t in ids):
        raise ValueError("the tokenizer lacks Whisper's task/timestamp special tokens")
    return ids


def process_whisper_prompt(prompt: Any, ctx: InputContext) -> ProcessedPrompt:
    """``{"multi_modal_data": {"audio": array | (array, sample_rate)}, ...}`` -> decoder ids + log-mel features.

    The decoder prompt is, in order of precedence: ``prompt_token_ids`` as given; ``prompt`` text that
    contains <|startoftranscript|>, tokenized as is; otherwise the default prefix built from ``language``
    (default "en"), ``task`` ("transcribe" or "translate") and ``timestamps`` (default False), preceded,
    when ``prompt`` is plain text, by ``<|startofprev|> text`` (Whisper's way to condition on earlier
    words). Audio longer than the model's window (30 s) is refused: ``LLM.transcribe`` and the
    transcription endpoint split long audio into windows.
    """
    if isinstance(prompt, str):
        raise ValueError("Whisper needs audio: pass {'prompt': ..., 'multi_modal_data': {'audio': (array, "
                         "sample_rate)}}")
    if not isinstance(prompt, dict):
        raise TypeError(f"prompt must be a dict with multi_modal_data.audio, got {type(prompt).__name__}")
    mm = prompt.get("multi_modal_data") or {}
    if "audio" not in mm:
        raise ValueError("Whisper needs audio: multi_modal_data.audio is missing")
    tok = ctx.tokenizer
    fe = _feature_extractor(ctx)
    audio = _audio_array(mm["audio"], int(fe.sampling_rate))
    if len(audio) > fe.n_samples:
        raise ValueError(f"audio is {len(audio) / fe.sampling_rate:.1f} s long; one Whisper request takes at "
                         f"most {fe.n_samples / fe.sampling_rate:.0f} s (LLM.transcribe splits longer audio)")

    text = prompt.get("prompt")
    if prompt.get("prompt_token_ids") is not None:
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) for t in ids):
            raise ValueError("prompt_token_ids must be a list of integers")
        ids = list(ids)
    elif isinstance(text, str) and SOT in text:
        ids = list(tok.encode(text, add_special_tokens=False))
    else:
        ids = decoder_prefix(tok, prompt.get("language", "en"), prompt.get("task", "transcribe"),
                             bool(prompt.get("timestamps", False)))
        if isinstance(text, str) and text.strip():
            prev = _token_id(tok, START_OF_PREV)
            if prev is None:
                raise ValueError(f"the tokenizer has no {START_OF_PREV} token for a text prompt")
            ids = [prev] + list(tok.encode(" " + text.strip(), add_special_tokens=False)) + ids
        elif text is not None and not isinstance(text, str):
            raise ValueError("prompt must be a string")

    feats = fe(audio, sampling_rate=fe.sampling_rate, return_tensors="pt")["input_features"][0]
    num_frames = int(feats.shape[-1])
    num_encoder_tokens = (num_frames - 1) // 2 + 1  # conv2 has stride 2
    max_src = int(ctx.hf_config.max_source_positions)
    if num_encoder_tokens != max_src:
        raise ValueError(f"the feature extractor gives {num_frames} frames ({num_encoder_tokens} encoder "
                         f"positions) but the model takes {2 * max_src} frames ({max_src} positions): its "
                         f"chunk_length does not fit the model config")
    return ProcessedPrompt(prompt_token_ids=ids, prompt=text if isinstance(text, str) else None,
                           encoder_inputs=feats, num_encoder_tokens=num_encoder_tokens)
