"""Qwen2-VL and Qwen2.5-VL: a vision transformer with dynamic resolution and the Qwen2 decoder with M-RoPE.

An image becomes as many embeddings as its processor's grid has merged patches (t*h*w / merge**2), so its
``<|image_pad|>`` placeholder is expanded to that count. The decoder's rotary positions are three-dimensional
(temporal, height, width): text tokens count up on all three; an image's tokens take its grid's coordinates
offset by the position where it starts, and the text after it continues from the largest of them + 1. A
request's prompt positions therefore differ from its token indices by a fixed delta past its last image, which
the runner keeps per request (``get_mrope_input_positions``) for the tokens it generates.
"""
from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from model_registry.layers import ShardsByHeads, copy_checked
from model_registry.layers.rotary import MRotaryEmbedding, rope_parameters
from model_registry.models.language_model_shell import LanguageModelShell
from model_registry.models.llama import LlamaForCausalLM
from model_registry.models.mm_prompt import image_processor, placeholder_prompt
from model_registry.models.qwen2_vl_video import VIDEO_FPS, image_patches, video_patches
from model_registry.models.qwen2_vl_vision import Qwen2VisionTransformer
from vllite_core.attention.backend import AttentionBackend
from vllite_core.errors import InvalidRequestError
from vllite_core.inputs import InputContext, ProcessedPrompt
from vllite_core.model_interfaces import SupportsMRoPE, SupportsMultiModalDecoder
from vllite_core.multimodal.features import MultiModalFeature, expand_each
from vllite_core.multimodal.images import hash_image, hash_video, prompt_videos


class Qwen2VLForConditionalGeneration(LanguageModelShell, nn.Module, ShardsByHeads, SupportsMultiModalDecoder,
                                      SupportsMRoPE):
    """Tensor-parallel: the language model is sharded (its heads must split); the vision transformer and its merger
    (replicated layers) run whole on every rank, so each rank computes the same image and video embeddings."""

    tp_sub_config = "text_config"
    supported_modalities = ("image", "video")
    v25 = False  # Qwen2.5-VL's vision blocks (RMSNorm, gated MLP, window attention)

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = hf_config
        tc = copy.copy(hf_config.get_text_config())
        # transformers 5 keeps tie_word_embeddings on the outer config only (Qwen2-VL-2B ties its head).
        tc.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.visual = Qwen2VisionTransformer(hf_config.vision_config, self.v25, dtype)
        self.merge = int(hf_config.vision_config.spatial_merge_size)
        self.language_model = LlamaForCausalLM(tc, attn_backend, dtype)
        section = rope_parameters(tc).get("mrope_section") or [16, 24, 24]
        self.language_model.model.rotary_emb = MRotaryEmbedding(tc, self.language_model.head_size, list(section))
        self.vocab_size: int = tc.vocab_size
        self.dtype = dtype

    # ---- prompts -----------------------------------------------------------------------------------
    @classmethod
    def chat_image_token_ids(cls, hf_config: Any) -> list[int]:
        """``<|vision_start|><|image_pad|><|vision_end|>``, as Qwen's chat template writes an image."""
        return [int(hf_config.vision_start_token_id), cls.image_token_id(hf_config),
                int(hf_config.vision_end_token_id)]

    @classmethod
    def process_prompt(cls, prompt: Any, ctx: InputContext) -> ProcessedPrompt:
        """``<|vision_start|><|image_pad|><|vision_end|>`` per image and ``<|vision_start|><|video_pad|>
        <|vision_end|>`` per video in the text (or one ``image_token_id`` / ``video_token_id`` per item in
        ``prompt_token_ids``); each pad is expanded to its item's merged patches. Patches and grid come from the
        folder's image processor, one image (or video frame) at a time (sizes differ)."""
        c = ctx.hf_config
        image_id, video_id = cls.image_token_id(c), int(c.video_token_id)
        text, ids, images = placeholder_prompt(prompt, ctx, image_id, cls.supported_modalities)
        videos = prompt_videos(prompt, cls.supported_modalities)
        if ids.count(video_id) != len(videos):
            raise InvalidRequestError("multi_modal_data", f"the prompt has {ids.count(video_id)} video placeholder(s) "
                                      f"for {len(videos)} video(s)")
        if not images and not videos:
            return ProcessedPrompt(prompt_token_ids=ids, prompt=text)
        proc = image_processor(ctx)
        vc = c.vision_config
        items = [("image", hash_image(img), *image_patches(proc, img, vc)) for img in images]
        interval = cls.video_time_interval(c)
        items += [("video", hash_video(frames), *video_patches(proc, frames, vc)) for frames in videos]
        merge = int(vc.spatial_merge_size)
        lengths = [t * h * w // merge ** 2 for *_, (t, h, w) in items]
        ids, offsets = expand_each(ids, {image_id: lengths[:len(images)], video_id: lengths[len(images):]})
        features = [MultiModalFeature(kind, key, off, n, {"pixel_values": px, "image_grid_thw": grid,
                                                          "time_interval": interval if kind == "video" else 1.0})
                    for (kind, key, px, grid), off, n in zip(items, offsets[image_id] + offsets[video_id], lengths)]
        features.sort(key=lambda f: f.offset)
        return ProcessedPrompt(prompt_token_ids=ids, prompt=text, mm_features=features)

    @classmethod
    def video_time_interval(cls, hf_config: Any) -> float:
        """How far M-RoPE's temporal position moves per temporal patch of a video: 1 for Qwen2-VL."""
        return 1.0

    def get_mrope_input_positions(self, input_tokens: list[int], mm_features: list[MultiModalFeature]
                                  ) -> tuple[torch.Tensor, int]:
        """The prompt's [3, n] positions and the delta (largest position + 1 - n) of every later token."""
        parts: list[torch.Tensor] = []
        pos = end = 0
        for f in sorted(mm_features, key=lambda f: f.offset):
            text = f.offset - end
            parts.append(torch.arange(pos, pos + text).expand(3, -1))
            pos += text
            t, h, w = f.data["image_grid_thw"]
            gh, gw = h // self.merge, w // self.merge
            ts = (torch.arange(t) * f.data.get("time_interval", 1.0)).long()  # a video's frames spaced in time
            grid = torch.stack(torch.meshgrid(ts, torch.arange(gh), torch.arange(gw), indexing="ij"))
            parts.append(grid.reshape(3, -1) + pos)
            pos += max(gh, gw)
            end = f.end
        parts.append(torch.arange(pos, pos + len(input_tokens) - end).expand(3, -1))
        positions = torch.cat(parts, dim=1)
        return positions, int(positions.max()) + 1 - len(input_tokens)

    # ---- the engine's model contract ---------------------------------------------------------------
    @torch.inference_mode()
    def embed_multimodal(self, data: list[dict]) -> list[torch.Tensor]:
        """Per image, its merged patch embeddings [t*h*w / merge**2, text hidden]; the step's images packed."""
        dev = self.visual.patch_embed.weight.device
        grids = [tuple(d["image_grid_thw"]) for d in data]
        patches = torch.cat([d["pixel_values"] for d in data]).to(dev, self.dtype)
        out = self.visual(patches, grids)
        return list(out.split([t * h * w // self.merge ** 2 for t, h, w in grids]))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF names, new (``model.visual.*``, ``model.language_model.*``) or old (``visual.*``, ``model.*``)."""
        vision: list[tuple[str, torch.Tensor]] = []
        text: list[tuple[str, torch.Tensor]] = []
        for name, tensor in weights:
            if name.startswith(("model.visual.", "visual.")):
                vision.append((name.split("visual.", 1)[1], tensor))
            elif name.startswith("model.language_model."):
                text.append(("model." + name.removeprefix("model.language_model."), tensor))
            elif name.startswith(("model.", "lm_head")):
                text.append((name, tensor))
            else:
                raise ValueError(f"checkpoint has weights this model does not know: {name}")
        loaded = {"visual." + n for n in self.visual.load(vision, copy_checked)}
        return loaded | {"language_model." + n for n in self.language_model.load_weights(text)}


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    v25 = True

    @classmethod
    def video_time_interval(cls, hf_config: Any) -> float:
        """Qwen2.5-VL ties a video's temporal positions to time: ``tokens_per_second`` per second of video, a
        temporal patch being ``temporal_patch_size / fps`` seconds (frames taken at VIDEO_FPS, as its processor
        samples them)."""
        vc = hf_config.vision_config
        return float(vc.tokens_per_second) * int(vc.temporal_patch_size) / VIDEO_FPS
