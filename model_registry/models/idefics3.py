"""Idefics3 (SmolVLM): a SigLIP-shaped tower run per image tile, a connector that pixel-shuffles each tile's patch
grid (``scale_factor`` x ``scale_factor`` neighbours into one row) and projects it, and a Llama decoder.

An image is written ``<image>`` in a prompt. As transformers' Idefics3Processor does, the image processor cuts it
into rows x cols tiles plus a downscaled global view, and the placeholder becomes, per tile row,
``<fake_token_around_image><row_r_col_c>`` + ``image_seq_len`` image tokens for each tile and a newline, then a
newline, ``<fake_token_around_image><global-img>`` + the global view's image tokens + ``<fake_token_around_image>``.
Each tile's run of image tokens is one multimodal item here (its own encoder-cache entry), since the runs are
separated by text tokens.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model_registry.layers import ShardsByHeads, copy_checked, empty_param
from model_registry.models.language_model_shell import LanguageModelShell
from model_registry.models.llama import LlamaForCausalLM
from model_registry.models.mm_prompt import image_processor, placeholder_prompt
from model_registry.models.siglip import SiglipVisionTower
from vllite_core.attention.backend import AttentionBackend
from vllite_core.errors import InvalidRequestError
from vllite_core.inputs import InputContext, ProcessedPrompt
from vllite_core.model_interfaces import SupportsMultiModalDecoder
from vllite_core.multimodal.features import MultiModalFeature
from vllite_core.multimodal.images import hash_image

FAKE, GLOBAL = "<fake_token_around_image>", "<global-img>"


class Idefics3VisionTower(SiglipVisionTower):
    """SigLIP's tower with Idefics3's positions: each patch's fractional (row, column) bucketed over the
    position grid (a whole tile: the grid in order)."""

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = F.conv2d(pixels.to(self.patch_embedding.dtype), self.patch_embedding, self.patch_bias,
                     stride=self.patch_size)
        h, w = x.shape[-2:]
        x = x.flatten(2).transpose(1, 2)
        side = int(self.num_positions ** 0.5)
        bounds = torch.arange(1 / side, 1.0, 1 / side, device=x.device)

        def buckets(n: int) -> torch.Tensor:
            frac = torch.clamp(torch.arange(n, device=x.device, dtype=torch.float32) * (1.0 / n), max=1.0 - 1e-6)
            return torch.bucketize(frac, bounds, right=True)

        ids = (buckets(h)[:, None] * side + buckets(w)[None, :]).reshape(-1)
        x = x + self.position_embedding[ids]
        for layer in self.layers:
            x = layer(x)
        return self.post_layernorm(x)


def pixel_shuffle(x: torch.Tensor, s: int) -> torch.Tensor:
    """[B, n*n, d] patch rows -> [B, n*n/s^2, d*s^2]: each s x s block of neighbours in one row, in the order
    transformers' connector uses."""
    b, seq, d = x.shape
    n = int(seq ** 0.5)
    x = x.view(b, n, n // s, d * s).permute(0, 2, 1, 3).reshape(b, n // s, n // s, d * s * s)
    return x.permute(0, 2, 1, 3).reshape(b, seq // (s * s), d * s * s)


class Idefics3ForConditionalGeneration(LanguageModelShell, nn.Module, ShardsByHeads, SupportsMultiModalDecoder):
    """Tensor-parallel: the language model is sharded (its heads must split); the SigLIP tower and the connector
    (replicated layers) run whole on every rank, so each rank computes the same image embeddings."""

    tp_sub_config = "text_config"
    supported_modalities = ("image",)

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = hf_config
        vc, tc = hf_config.vision_config, hf_config.text_config
        self.scale = int(hf_config.scale_factor)
        self.vision_tower = Idefics3VisionTower(vc, dtype)
        self.proj = empty_param(tc.hidden_size, vc.hidden_size * self.scale ** 2, dtype=dtype)
        self.language_model = LlamaForCausalLM(tc, attn_backend, dtype)
        self.vocab_size: int = tc.vocab_size
        self.dtype = dtype

    # ---- prompts -----------------------------------------------------------------------------------
    @staticmethod
    def image_seq_len(hf_config: Any) -> int:
        vc = hf_config.vision_config
        return (vc.image_size // vc.patch_size) ** 2 // int(hf_config.scale_factor) ** 2

    @classmethod
    def process_prompt(cls, prompt: Any, ctx: InputContext) -> ProcessedPrompt:
        """``<image>`` per image in the text (or ``prompt_token_ids``), expanded to its tiles as the processor
        does; each tile's image tokens are one item with the tile's pixels."""
        c, tok = ctx.hf_config, ctx.tokenizer
        image_id = cls.image_token_id(c)
        text, ids, images = placeholder_prompt(prompt, ctx, image_id, cls.supported_modalities)
        if not images:
            return ProcessedPrompt(prompt_token_ids=ids, prompt=text)
        n, size = cls.image_seq_len(c), c.vision_config.image_size
        fake, glob = tok.convert_tokens_to_ids(FAKE), tok.convert_tokens_to_ids(GLOBAL)
        row_end = tok.encode("\n", add_special_tokens=False)  # the newlines sit between special tokens
        before_global = tok.encode("\n\n", add_special_tokens=False)
        out: list[int] = []
        features: list[MultiModalFeature] = []
        it = iter(images)
        for t in ids:
            if t != image_id:
                out.append(t)
                continue
            img = next(it)
            proc = image_processor(ctx)([[img]], return_tensors="pt", return_row_col_info=True)
            rows, cols = int(proc["rows"][0][0]), int(proc["cols"][0][0])
            tiles = proc["pixel_values"][0]
            mask = proc.get("pixel_attention_mask")
            if tiles.shape[0] != rows * cols + 1 or tuple(tiles.shape[-2:]) != (size, size) or (
                    mask is not None and not bool(mask[0].all())):
                raise InvalidRequestError("multi_modal_data", f"the image processor gives {tuple(tiles.shape)} "
                                          f"pixels for {rows}x{cols} tiles; the vision tower takes whole "
                                          f"{size}x{size} tiles")
            key = hash_image(img)

            def tile(k: int, prefix: list[int]) -> None:
                out.extend(prefix)
                features.append(MultiModalFeature("image", f"{key}:{k}", len(out), n, tiles[k]))
                out.extend([image_id] * n)

            if rows == 0 and cols == 0:
                tile(0, [fake, glob])
            else:
                for r in range(rows):
                    for col in range(cols):
                        tile(r * cols + col, [fake, tok.convert_tokens_to_ids(f"<row_{r + 1}_col_{col + 1}>")])
                    out.extend(row_end if r < rows - 1 else before_global)
                tile(rows * cols, [fake, glob])
            out.append(fake)
        return ProcessedPrompt(prompt_token_ids=out, prompt=text, mm_features=features)

    # ---- the engine's model contract ---------------------------------------------------------------
    @torch.inference_mode()
    def embed_multimodal(self, pixel_values: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per tile, its pixel-shuffled, projected patch embeddings [image_seq_len, text hidden]."""
        pixels = torch.stack(pixel_values).to(self.proj.device, self.dtype)
        return list((pixel_shuffle(self.vision_tower(pixels), self.scale) @ self.proj.t()).unbind(0))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF names: ``model.vision_model.*``, ``model.connector.modality_projection.proj.weight``,
        ``model.text_model.*``, ``lm_head.weight``."""
        text: list[tuple[str, torch.Tensor]] = []
        vision: list[tuple[str, torch.Tensor]] = []
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name.startswith("vision_model."):
                vision.append((name, tensor))
            elif name == "connector.modality_projection.proj.weight":
                copy_checked(self.proj.data, tensor, name)
                loaded.add("proj")
            elif name.startswith("text_model."):
                text.append(("model." + name.removeprefix("text_model."), tensor))
            elif name.startswith("lm_head."):
                text.append((name, tensor))
            else:
                raise ValueError(f"checkpoint has weights this model does not know: {name}")
        loaded |= {"vision_tower." + n for n in self.vision_tower.load(vision, copy_checked)}
        loaded |= {"language_model." + n for n in self.language_model.load_weights(text)}
        return loaded
