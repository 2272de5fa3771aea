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

from model_registry.layers import copy_checked
from model_registry.layers.rotary import MRotaryEmbedding, rope_parameters
from model_registry.models.language_model_shell import LanguageModelShell
from model_registry.models.llama import LlamaForCausalLM
from model_registry.models.mm_prompt import image_processor, placeholder_prompt
from model_registry.models.qwen2_vl_vision import Qwen2VisionTransformer
from vllite_core.attention.backend import AttentionBackend
from vllite_core.errors import InvalidRequestError
from vllite_core.inputs import InputContext, ProcessedPrompt
from vllite_core.model_interfaces import SupportsMRoPE, SupportsMultiModalDecoder
from vllite_core.multimodal.features import MultiModalFeature, expand_placeholders
from vllite_core.multimodal.images import hash_image


class Qwen2VLForConditionalGeneration(LanguageModelShell, nn.Module, SupportsMultiModalDecoder, SupportsMRoPE):
    supported_modalities = ("image",)
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
    def image_token_id(cls, hf_config: Any) -> int:
        return int(hf_config.image_token_id)

    @classmethod
    def chat_image_token_ids(cls, hf_config: Any) -> list[int]:
        """``<|vision_start|><|image_pad|><|vision_end|>``, as Qwen's chat template writes an image."""
        return [int(hf_config.vision_start_token_id), cls.image_token_id(hf_config),
                int(hf_config.vision_end_token_id)]

    @classmethod
    def process_prompt(cls, prompt: Any, ctx: InputContext) -> ProcessedPrompt:
        """``<|vision_start|><|image_pad|><|vision_end|>`` per image in the text (or one ``image_token_id``
        per image in ``prompt_token_ids``); each ``<|image_pad|>`` is expanded to the image's merged patches.
        Patches and grid come from the folder's image processor, one image at a time (sizes differ)."""
        c = ctx.hf_config
        image_id = cls.image_token_id(c)
        text, ids, images = placeholder_prompt(prompt, ctx, image_id, cls.supported_modalities)
        if not images:
            return ProcessedPrompt(prompt_token_ids=ids, prompt=text)
        proc = image_processor(ctx)
        vc = c.vision_config
        merge = int(vc.spatial_merge_size)
        patch_dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
        data, lengths = [], []
        for img in images:
            out = proc([img], return_tensors="pt")
            pixels, grid = out["pixel_values"], tuple(int(v) for v in out["image_grid_thw"][0])
            if pixels.shape[-1] != patch_dim or grid[1] % merge or grid[2] % merge:
                raise InvalidRequestError("multi_modal_data", f"the image processor gives patches of "
                                          f"{pixels.shape[-1]} values on a {grid} grid; the vision tower takes "
                                          f"{patch_dim} on grids divisible by {merge}")
            data.append({"pixel_values": pixels, "image_grid_thw": grid})
            lengths.append(grid[0] * grid[1] * grid[2] // merge ** 2)
        ids, offsets = expand_placeholders(ids, image_id, lengths)
        features = [MultiModalFeature("image", hash_image(img), off, n, d)
                    for img, off, n, d in zip(images, offsets, lengths, data)]
        return ProcessedPrompt(prompt_token_ids=ids, prompt=text, mm_features=features)

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
            grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij"))
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
