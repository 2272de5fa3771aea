"""Qwen2-Audio: a Whisper-shaped audio encoder, a linear projector and the built-in Qwen2 decoder.

A clip becomes log-mel features from the folder's ``WhisperFeatureExtractor``, padded to the encoder's window
(``2 * max_source_positions`` frames, 30 s for the released models; a longer clip is cut there, as
transformers' processor does). Its ``<|AUDIO|>`` placeholder is expanded to the encoder's row count for the
clip's frames (conv stride 2, then average pooling by 2). The encoder runs on the whole padded window with
the padding frames hidden as attention keys, as transformers runs it, so the rows are HF's.
"""
from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model_registry.layers import load_parameter
from model_registry.layers.tensor_parallel import ShardsHybrid
from model_registry.models.clip import linear
from model_registry.models.language_model_shell import LanguageModelShell
from model_registry.models.llama import LlamaForCausalLM
from model_registry.models.mm_prompt import feature_extractor, prompt_text_ids
from model_registry.models.whisper import WhisperEncoder
from vllite_core.attention.backend import AttentionBackend
from vllite_core.audio import resample
from vllite_core.distributed.sharding import check_heads, shard_heads
from vllite_core.errors import InvalidRequestError
from vllite_core.inputs import InputContext, ProcessedPrompt
from vllite_core.model_interfaces import SupportsMultiModalDecoder
from vllite_core.multimodal.audio import hash_audio, prompt_audios
from vllite_core.multimodal.features import MultiModalFeature, expand_placeholders

AUDIO_BOS, AUDIO_EOS = "<|audio_bos|>", "<|audio_eos|>"


@dataclass
class AudioFeatures:
    """One clip as the encoder takes it: log-mel features over the whole window and how many frames are audio."""

    input_features: torch.Tensor  # [mels, window frames]
    num_frames: int


def num_audio_tokens(num_frames: int) -> int:
    """Encoder rows for ``num_frames`` mel frames: conv stride 2, then average pooling by 2."""
    return ((num_frames - 1) // 2 + 1 - 2) // 2 + 1


class Qwen2AudioEncoder(WhisperEncoder):
    """Whisper's encoder (conv stem, learned positions, pre-LN layers) with the padding frames masked and an
    average pool by 2 before the final norm."""

    def forward(self, features: torch.Tensor, num_frames: list[int]) -> torch.Tensor:  # type: ignore[override]
        h = F.gelu(self.conv1(features))
        h = F.gelu(self.conv2(h)).transpose(1, 2)
        s = h.shape[1]
        h = h + self.embed_positions.weight[:s]
        valid = torch.tensor([(n - 1) // 2 + 1 for n in num_frames], device=h.device)
        mask = (torch.arange(s, device=h.device)[None, :] < valid[:, None])[:, None, None, :]
        for layer in self.layers:
            h = layer(h, mask)
        h = F.avg_pool1d(h.transpose(1, 2), 2, 2).transpose(1, 2)
        return self.layer_norm(h)


class Qwen2AudioForConditionalGeneration(LanguageModelShell, nn.Module, ShardsHybrid, SupportsMultiModalDecoder):
    """Tensor-parallel: the language model is sharded by its heads, and so is the audio encoder (Whisper's layers:
    its heads must split too); the projector is whole on every rank."""

    supported_modalities = ("audio",)
    tp_sub_config = "text_config"
    whole_elsewhere = "the projector whole on every rank"

    @classmethod
    def check_mixers(cls, hf_config: Any, tensor_parallel_size: int) -> None:
        heads = hf_config.audio_config.encoder_attention_heads
        check_heads(heads, heads, tensor_parallel_size)

    @classmethod
    def mixer_layout(cls, hf_config: Any, tensor_parallel_size: int, rank: int) -> str:
        heads = hf_config.audio_config.encoder_attention_heads
        s = shard_heads(heads, heads, tensor_parallel_size, rank)
        return f"audio encoder heads {s.q_start}-{s.q_start + s.num_heads - 1} ({s.num_heads}) of {heads}"

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = hf_config
        ac = hf_config.audio_config
        if getattr(ac, "activation_function", "gelu") != "gelu":
            raise NotImplementedError(f"Qwen2-Audio encoder activation {ac.activation_function!r} (gelu only)")
        tc = copy.copy(hf_config.get_text_config())
        tc.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.audio_tower = Qwen2AudioEncoder(ac, dtype)
        self.multi_modal_projector = nn.Module()
        self.multi_modal_projector.linear = linear(ac.d_model, tc.hidden_size, dtype)
        self.language_model = LlamaForCausalLM(tc, attn_backend, dtype)
        self.vocab_size: int = tc.vocab_size
        self.dtype = dtype

    # ---- prompts -----------------------------------------------------------------------------------
    @classmethod
    def audio_token_id(cls, hf_config: Any) -> int:
        return int(hf_config.audio_token_index)

    @classmethod
    def chat_audio_token_ids(cls, hf_config: Any, tokenizer: Any) -> list[int]:
        """``<|audio_bos|><|AUDIO|><|audio_eos|>``, as Qwen2-Audio's chat template writes an audio part."""
        bos, eos = tokenizer.convert_tokens_to_ids([AUDIO_BOS, AUDIO_EOS])
        return [bos, cls.audio_token_id(hf_config), eos]

    @classmethod
    def process_prompt(cls, prompt: Any, ctx: InputContext) -> ProcessedPrompt:
        """``{"prompt": "...<|audio_bos|><|AUDIO|><|audio_eos|>...", "multi_modal_data": {"audio": (samples, rate)
        or a list}}`` (or ``prompt_token_ids`` holding one ``audio_token_index`` per clip): each placeholder is
        expanded to its clip's encoder rows; clips are resampled to the feature extractor's rate."""
        audio_id = cls.audio_token_id(ctx.hf_config)
        fe = feature_extractor(ctx)
        clips = prompt_audios(prompt, fe.sampling_rate)
        text, ids = prompt_text_ids(prompt, ctx)
        if ids.count(audio_id) != len(clips):
            raise InvalidRequestError("multi_modal_data", f"the prompt has {ids.count(audio_id)} audio placeholder(s) "
                                      f"({ctx.tokenizer.convert_ids_to_tokens(audio_id)!r}) for {len(clips)} clip(s)")
        if not clips:
            return ProcessedPrompt(prompt_token_ids=ids, prompt=text)
        samples = [resample(s, sr, fe.sampling_rate) for s, sr in clips]
        out = fe(samples, sampling_rate=fe.sampling_rate, return_attention_mask=True, padding="max_length",
                 return_tensors="pt")
        window = 2 * int(ctx.hf_config.audio_config.max_source_positions)
        got = out["input_features"].shape[-1]
        if got != window:
            raise InvalidRequestError("multi_modal_data", f"the feature extractor gives {got} frames, the audio "
                                      f"encoder takes {window}")
        frames = [int(n) for n in out["attention_mask"].sum(-1)]
        lengths = [num_audio_tokens(n) for n in frames]
        if min(lengths) < 1:
            raise InvalidRequestError("multi_modal_data", f"audio {lengths.index(min(lengths))} is too short "
                                      f"(under {3 * fe.hop_length} samples at {fe.sampling_rate} Hz)")
        ids, offsets = expand_placeholders(ids, audio_id, lengths)
        features = [MultiModalFeature("audio", hash_audio(s, fe.sampling_rate), off, n,
                                      AudioFeatures(out["input_features"][i], frames[i]))
                    for i, (s, off, n) in enumerate(zip(samples, offsets, lengths))]
        return ProcessedPrompt(prompt_token_ids=ids, prompt=text, mm_features=features)

    # ---- the engine's model contract ---------------------------------------------------------------
    @torch.inference_mode()
    def embed_multimodal(self, data: list[AudioFeatures]) -> list[torch.Tensor]:
        """Per clip, its projected encoder rows [audio tokens, text hidden]; the step's clips in one batch."""
        dev = self.multi_modal_projector.linear.weight.device
        feats = torch.stack([d.input_features for d in data]).to(dev, self.dtype)
        out = self.multi_modal_projector.linear(self.audio_tower(feats, [d.num_frames for d in data]))
        return [out[i, :num_audio_tokens(d.num_frames)] for i, d in enumerate(data)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF names, new (``model.audio_tower.*``, ``model.language_model.*``, ``lm_head``) or old
        (``audio_tower.*``, ``language_model.model.*``, ``language_model.lm_head``)."""
        own = dict(self.audio_tower.named_parameters(prefix="audio_tower"))
        own.update(self.multi_modal_projector.named_parameters(prefix="multi_modal_projector"))
        text: list[tuple[str, torch.Tensor]] = []
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name in own:
                load_parameter(own[name], tensor.to(own[name].dtype), None, name)  # this rank's slice when sharded
                loaded.add(name)
            elif name.startswith("language_model."):
                sub = name.removeprefix("language_model.")
                text.append((sub if sub.startswith(("model.", "lm_head")) else "model." + sub, tensor))
            elif name.startswith("lm_head."):
                text.append((name, tensor))
            else:
                raise ValueError(f"checkpoint has weights this model does not know: {name}")
        return loaded | {"language_model." + n for n in self.language_model.load_weights(text)}

