"""Gemma 3 with images: a SigLIP tower, a projector that average-pools the patch grid to ``mm_tokens_per_image``
tokens, RMS-norms ((1 + w) form) and projects them, and the Gemma 3 decoder; pan-and-scan is off.

An image is written ``<start_of_image>`` in a prompt; as transformers' Gemma3Processor does, it becomes
``\\n\\n<start_of_image>`` + ``mm_tokens_per_image`` image tokens + ``<end_of_image>\\n\\n``, the newlines
tokenized with the text they touch. An image's tokens attend to each other both ways: the scheduler keeps an
image's tokens in one step (``HasBidirectionalMMItems``) and ``forward`` marks each run of image tokens as a
non-causal span (``vllite_core.attention.spans``). Image rows are not scaled by sqrt(hidden) like text
embeddings (``embed_input_ids`` scales the text ones).
"""
from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model_registry.layers import ShardsByHeads, empty_param
from model_registry.layers.norm import GemmaRMSNorm
from model_registry.models.gemma import Gemma3ForCausalLM
from model_registry.models.language_model_shell import LanguageModelShell
from model_registry.models.llava import load_vlm_weights
from model_registry.models.mm_prompt import image_processor, placeholder_prompt
from model_registry.models.siglip import SiglipVisionTower
from vllite_core.attention.backend import AttentionBackend, AttentionMetadata
from vllite_core.attention.spans import token_spans
from vllite_core.errors import InvalidRequestError
from vllite_core.inputs import InputContext, ProcessedPrompt
from vllite_core.model_interfaces import HasBidirectionalMMItems, SupportsMultiModalDecoder
from vllite_core.multimodal.features import MultiModalFeature
from vllite_core.multimodal.images import hash_image

NEWLINES = "\n\n"


class Gemma3Projector(nn.Module):
    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        vc = hf_config.vision_config
        self.mm_input_projection_weight = empty_param(vc.hidden_size, hf_config.text_config.hidden_size, dtype=dtype)
        self.mm_soft_emb_norm = GemmaRMSNorm(vc.hidden_size, vc.layer_norm_eps, dtype)
        self.patches = vc.image_size // vc.patch_size
        self.kernel = self.patches // int(hf_config.mm_tokens_per_image ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, d = x.shape
        grid = x.transpose(1, 2).reshape(b, d, self.patches, self.patches)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight)


def expand_images(ids: list[int], tok: Any, boi: int, image: int, eoi: int, n: int) -> tuple[list[int], list[int]]:
    """Each ``boi`` -> newlines, boi, ``n`` image tokens, eoi, newlines, the text runs next to an image
    re-tokenized with its newlines (as the processor tokenizes the expanded text: special tokens split it).
    Returns the ids and each image's first image-token offset."""
    special = set(tok.all_special_ids) | {boi, image, eoi}
    out: list[int] = []
    offsets: list[int] = []
    run: list[int] = []  # text ids since the last special token
    after_image = False

    def flush(before_image: bool) -> None:
        if not (after_image or before_image):
            out.extend(run)
            return
        text = tok.decode(run, skip_special_tokens=False, clean_up_tokenization_spaces=False) if run else ""
        text = (NEWLINES if after_image else "") + text + (NEWLINES if before_image else "")
        out.extend(tok.encode(text, add_special_tokens=False))

    for t in ids:
        if t not in special:
            run.append(t)
            continue
        flush(t == boi)
        run = []
        if t == boi:
            offsets.append(len(out) + 1)
            out.extend([boi] + [image] * n + [eoi])
        else:
            out.append(t)
        after_image = t == boi
    flush(False)
    return out, offsets


class Gemma3ForConditionalGeneration(LanguageModelShell, nn.Module, ShardsByHeads, SupportsMultiModalDecoder,
                                     HasBidirectionalMMItems):
    """Tensor-parallel: the language model is sharded (its heads must split); the SigLIP tower and the projector
    (replicated layers) run whole on every rank, so each rank computes the same image embeddings."""

    tp_sub_config = "text_config"
    supported_modalities = ("image",)

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = hf_config
        vc = hf_config.vision_config
        if getattr(vc, "model_type", "siglip_vision_model") != "siglip_vision_model":
            raise NotImplementedError(f"Gemma 3 with a {vc.model_type} vision tower is not supported (SigLIP only)")
        tc = copy.copy(hf_config.get_text_config())
        tc.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", getattr(tc, "tie_word_embeddings",
                                                                                            True)))
        self.vision_tower = SiglipVisionTower(vc, dtype)
        self.multi_modal_projector = Gemma3Projector(hf_config, dtype)
        self.language_model = Gemma3ForCausalLM(tc, attn_backend, dtype)
        self.language_model.model.scale_inputs_embeds = False  # embed_input_ids scales the text rows
        self.embed_scale = torch.tensor(tc.hidden_size ** 0.5, dtype=dtype)
        self.image_id = self.image_token_id(hf_config)
        self.vocab_size: int = tc.vocab_size
        self.dtype = dtype

    # ---- prompts -----------------------------------------------------------------------------------
    @classmethod
    def image_token_id(cls, hf_config: Any) -> int:
        return int(hf_config.image_token_index)

    @classmethod
    def chat_image_token_ids(cls, hf_config: Any) -> list[int]:
        """``<start_of_image>``, as Gemma 3's chat template writes an image; ``process_prompt`` expands it."""
        return [int(hf_config.boi_token_index)]

    @classmethod
    def process_prompt(cls, prompt: Any, ctx: InputContext) -> ProcessedPrompt:
        """``<start_of_image>`` per image in the text (or in ``prompt_token_ids``), expanded as the processor
        does; pixels from the folder's image processor, pan-and-scan off."""
        c = ctx.hf_config
        boi, eoi = int(c.boi_token_index), int(c.eoi_token_index)
        text, ids, images = placeholder_prompt(prompt, ctx, boi, cls.supported_modalities)
        if not images:
            return ProcessedPrompt(prompt_token_ids=ids, prompt=text)
        n = int(c.mm_tokens_per_image)
        ids, offsets = expand_images(ids, ctx.tokenizer, boi, cls.image_token_id(c), eoi, n)
        pixels = image_processor(ctx)(images, do_pan_and_scan=False, return_tensors="pt")["pixel_values"]
        size = c.vision_config.image_size
        if tuple(pixels.shape[-2:]) != (size, size) or pixels.shape[0] != len(images):
            raise InvalidRequestError("multi_modal_data", f"the image processor gives {tuple(pixels.shape)} pixels, "
                                      f"the vision tower takes one {size}x{size} image each")
        features = [MultiModalFeature("image", hash_image(img), off, n, pixels[i])
                    for i, (img, off) in enumerate(zip(images, offsets))]
        return ProcessedPrompt(prompt_token_ids=ids, prompt=text, mm_features=features)

    # ---- the engine's model contract ---------------------------------------------------------------
    @torch.inference_mode()
    def embed_multimodal(self, pixel_values: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per image, its projected, pooled patch embeddings [mm_tokens_per_image, text hidden]."""
        dev = self.multi_modal_projector.mm_input_projection_weight.device
        pixels = torch.stack(pixel_values).to(dev, self.dtype)
        return list(self.multi_modal_projector(self.vision_tower(pixels)).unbind(0))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Text embeddings scaled by sqrt(hidden) in the model's dtype (image rows replace some unscaled)."""
        return self.language_model.embed_input_ids(input_ids) * self.embed_scale

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: list[AttentionMetadata], inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """A step with image rows (``inputs_embeds``) marks each run of image tokens as a non-causal span."""
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        else:
            md = attn_metadata[0]
            spans = token_spans(input_ids.tolist(), self.image_id, md.query_start_loc_cpu, md.seq_lens_cpu)
            if spans is not None:
                attn_metadata = [replace(m, noncausal_spans=spans) for m in attn_metadata]
        return self.language_model(input_ids, positions, kv_caches, attn_metadata, inputs_embeds=inputs_embeds)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_vlm_weights(self, weights)
