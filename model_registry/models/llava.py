"""Llava: a CLIP vision tower, a two-layer projector, and a built-in decoder (the Llama family), for the engine.

Prompts carry ``<image>`` placeholders, one per image; ``process_prompt`` expands each to the number of patch
embeddings the tower gives and records the ranges as ``MultiModalFeature``s. The runner asks
``embed_multimodal`` for an image's embeddings when the scheduled range first reaches it, caches them by the
image's content hash, and passes the step's token embeddings, placeholders replaced, as ``inputs_embeds``.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from model_registry.layers import ShardsByHeads, copy_checked, get_act_fn
from model_registry.models.clip import CLIPVisionTower, linear
from model_registry.models.language_model_shell import LanguageModelShell
from model_registry.models.llama import LlamaForCausalLM
from model_registry.models.mm_prompt import image_processor, placeholder_prompt
from vllite_core.attention.backend import AttentionBackend
from vllite_core.errors import InvalidRequestError
from vllite_core.inputs import InputContext, ProcessedPrompt
from vllite_core.model_interfaces import SupportsMultiModalDecoder
from vllite_core.multimodal.features import MultiModalFeature, expand_placeholders
from vllite_core.multimodal.images import hash_image


def _feature_layers(hf_config: Any) -> list[int]:
    """The tower's hidden-state indices Llava reads (0: embeddings, i: after layer i), negatives resolved."""
    layers = hf_config.vision_feature_layer
    layers = [layers] if isinstance(layers, int) else list(layers)
    n = hf_config.vision_config.num_hidden_layers
    return [layer if layer >= 0 else n + 1 + layer for layer in layers]


class LlavaProjector(nn.Module):
    def __init__(self, cin: int, cout: int, act: str, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear_1 = linear(cin, cout, dtype, bias)
        self.linear_2 = linear(cout, cout, dtype, bias)
        self.act = get_act_fn(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(LanguageModelShell, nn.Module, ShardsByHeads, SupportsMultiModalDecoder):
    """Tensor-parallel: the language model is sharded (its heads must split); the vision tower and the
    projector are small and run whole on every rank, so each rank computes the same image embeddings."""

    supported_modalities = ("image",)
    tp_sub_config = "text_config"

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = hf_config
        vc, tc = hf_config.vision_config, hf_config.text_config
        if getattr(vc, "model_type", "clip_vision_model") != "clip_vision_model":
            raise NotImplementedError(f"Llava with a {vc.model_type} vision tower is not supported (CLIP only)")
        if hf_config.vision_feature_select_strategy not in ("default", "full"):
            raise NotImplementedError(f"vision_feature_select_strategy {hf_config.vision_feature_select_strategy!r}")
        self.feature_layers = _feature_layers(hf_config)
        self.drop_cls = hf_config.vision_feature_select_strategy == "default"
        self.language_model = LlamaForCausalLM(tc, attn_backend, dtype)
        # With pipeline stages the tower and the projector live on the first stage (which embeds the tokens).
        self.stage = self.language_model.stage
        self.vision_tower = CLIPVisionTower(vc, dtype, num_layers=max(self.feature_layers)) \
            if self.stage.is_first else None
        self.multi_modal_projector = LlavaProjector(
            vc.hidden_size * len(self.feature_layers), tc.hidden_size, hf_config.projector_hidden_act,
            bool(getattr(hf_config, "multimodal_projector_bias", True)), dtype) if self.stage.is_first else None
        self.vocab_size: int = tc.vocab_size
        self.hidden_size: int = tc.hidden_size
        self.dtype = dtype

    # Pipeline stages: the language model's split (model_registry.models.llama); the image embeddings are made
    # and put in place on the first stage only (vllite_core.worker.pp_runner), the last computes the logits.
    supports_pipeline_parallel = True

    # ---- prompts -----------------------------------------------------------------------------------
    @classmethod
    def image_token_id(cls, hf_config: Any) -> int:
        """The placeholder token chat puts where an image goes."""
        return int(hf_config.image_token_index)

    @staticmethod
    def num_image_tokens(hf_config: Any) -> int:
        vc = hf_config.vision_config
        n = (vc.image_size // vc.patch_size) ** 2
        return n if hf_config.vision_feature_select_strategy == "default" else n + 1

    @classmethod
    def process_prompt(cls, prompt: Any, ctx: InputContext) -> ProcessedPrompt:
        """``{"prompt": "USER: <image>\\n...", "multi_modal_data": {"image": img or [imgs]}}`` (or
        ``prompt_token_ids`` holding one ``image_token_index`` per image): each placeholder is expanded to the
        image's embedding count; pixels come from the folder's image processor (transformers' PIL backend)."""
        c = ctx.hf_config
        image_id = int(c.image_token_index)
        text, ids, images = placeholder_prompt(prompt, ctx, image_id, cls.supported_modalities)
        if not images:
            return ProcessedPrompt(prompt_token_ids=ids, prompt=text)
        pixels = cls.pixel_values(images, ctx)
        n = cls.num_image_tokens(c)
        ids, offsets = expand_placeholders(ids, image_id, [n] * len(images))
        features = [MultiModalFeature("image", hash_image(img), off, n, pixels[i])
                    for i, (img, off) in enumerate(zip(images, offsets))]
        return ProcessedPrompt(prompt_token_ids=ids, prompt=text, mm_features=features)

    @classmethod
    def pixel_values(cls, images: list, ctx: InputContext) -> torch.Tensor:
        pixels = image_processor(ctx)(images, return_tensors="pt")["pixel_values"]
        size = ctx.hf_config.vision_config.image_size
        if tuple(pixels.shape[-2:]) != (size, size):
            raise InvalidRequestError("multi_modal_data", f"the image processor gives {tuple(pixels.shape[-2:])} "
                                      f"pixels, the vision tower takes {size}x{size}")
        return pixels

    # ---- the engine's model contract ---------------------------------------------------------------
    @torch.inference_mode()
    def embed_multimodal(self, pixel_values: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per image, its projected patch embeddings [num_image_tokens, text hidden]."""
        dev = self.multi_modal_projector.linear_1.weight.device
        pixels = torch.stack([p for p in pixel_values]).to(dev, self.dtype)
        states = self.vision_tower(pixels, self.feature_layers)
        if self.drop_cls:
            states = [s[:, 1:] for s in states]
        out = self.multi_modal_projector(torch.cat(states, dim=-1))
        return list(out.unbind(0))

    def skips_weight(self, hf_name: str) -> bool:
        """Another pipeline stage's tensor (the tower and the projector off the first stage, the language
        model's other layers): the loader does not read it."""
        if self.stage.is_whole:
            return False
        name = hf_name.removeprefix("model.")
        if name.startswith(("vision_tower.", "multi_modal_projector.")):
            return not self.stage.is_first
        text = _text_name(name)
        return text is not None and self.language_model.skips_weight(text)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_vlm_weights(self, ((n, t) for n, t in weights if not self.skips_weight(n)))


def _text_name(name: str) -> str | None:
    """The language model's name of a checkpoint tensor (``model.`` already removed), or None for another part."""
    if name.startswith("language_model."):
        sub = name.removeprefix("language_model.")
        return sub if sub.startswith(("model.", "lm_head")) else "model." + sub
    return name if name.startswith("lm_head.") else None


def load_vlm_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """A vision tower + projector + language model checkpoint (LLaVA, Gemma 3, ...) by HF name, old
    (``language_model.model.*``, ``vision_tower.vision_model.*``) or new (``model.language_model.*``) layout."""
    text: list[tuple[str, torch.Tensor]] = []
    vision: list[tuple[str, torch.Tensor]] = []
    loaded: set[str] = set()
    proj = dict(model.multi_modal_projector.named_parameters()) if model.multi_modal_projector is not None else {}
    for name, tensor in weights:
        name = name.removeprefix("model.")
        if name.startswith("vision_tower."):
            vision.append((name.removeprefix("vision_tower."), tensor))
        elif name.startswith("multi_modal_projector."):
            sub = name.removeprefix("multi_modal_projector.")
            if sub not in proj:
                raise ValueError(f"checkpoint has projector weights this model does not know: {name}")
            copy_checked(proj[sub].data, tensor, name)
            loaded.add("multi_modal_projector." + sub)
        elif (sub := _text_name(name)) is not None:
            text.append((sub, tensor))
        else:
            raise ValueError(f"checkpoint has weights this model does not know: {name}")
    if model.vision_tower is not None:  # None: a pipeline stage after the first
        loaded |= {"vision_tower." + n for n in model.vision_tower.load(vision, copy_checked)}
    loaded |= {"language_model." + n for n in model.language_model.load_weights(text)}
    return loaded
