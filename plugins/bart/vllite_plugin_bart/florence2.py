"""Florence-2 for the vllite engine (Florence2ForConditionalGeneration checkpoints, transformers' format).

Image + task prompt in, text out. The encoder side runs once per request:

  pixels -> DaViT vision tower (conv patch embeddings; per stage, blocks of a spatial block (depthwise
  conv, window attention, MLP) and a channel block (depthwise conv, channel-group attention, MLP))
  -> multi-modal projector (learned 2D positions, the first row of a sinusoidal temporal table, one
  spatially pooled token in front, linear projection, LayerNorm) = image tokens
  -> [image tokens ; embedded task-prompt tokens] -> BART encoder.

The decoder is BART's (see ``vllite_plugin_bart.bart``). The vision tower is written here for the
engine from transformers' Florence2 modeling (``Florence2VisionBackbone`` and
``Florence2MultiModalProjector``), with the same parameter names so checkpoints load 1:1.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model_registry.layers import TORCH_OPS, Conv2d, Embedding, LayerNorm, ParallelLMHead, get_act_fn
from vllite_core.attention.backend import AttentionBackend, AttentionMetadata
from vllite_core.core.kv_cache_spec import KVCacheSpec
from vllite_core.errors import InvalidRequestError
from vllite_core.inputs import InputContext, ProcessedPrompt
from vllite_core.model_interfaces import SupportsEncoderDecoder, SupportsMultiModal
from vllite_plugin_bart.bart import STACKED, BartModel, check_encoder_ids, decoder_prompt_ids, text_or_ids
from vllite_plugin_bart.layers import cfg, linear, load_hf_weights, model_device, sinusoid_table

# Florence-2's task tokens and the prompts they stand for (transformers' Florence2Processor).
TASK_PROMPTS = {
    "<OCR>": "What is the text in the image?",
    "<OCR_WITH_REGION>": "What is the text in the image, with regions?",
    "<CAPTION>": "What does the image describe?",
    "<DETAILED_CAPTION>": "Describe in detail what is shown in the image.",
    "<MORE_DETAILED_CAPTION>": "Describe with a paragraph what is shown in the image.",
    "<OD>": "Locate the objects with category name in the image.",
    "<DENSE_REGION_CAPTION>": "Locate the objects in the image, with their descriptions.",
    "<REGION_PROPOSAL>": "Locate the region proposals in the image.",
}
TASK_PROMPTS_WITH_INPUT = {
    "<CAPTION_TO_PHRASE_GROUNDING>": "Locate the phrases in the caption: {input}",
    "<REFERRING_EXPRESSION_SEGMENTATION>": "Locate {input} in the image with mask",
    "<REGION_TO_SEGMENTATION>": "What is the polygon mask of region {input}",
    "<OPEN_VOCABULARY_DETECTION>": "Locate {input} in the image.",
    "<REGION_TO_CATEGORY>": "What is the region {input}?",
    "<REGION_TO_DESCRIPTION>": "What does the region {input} describe?",
    "<REGION_TO_OCR>": "What text is in the region {input}?",
}


def task_prompt(text: str) -> str:
    """The text a task token stands for (a task without input must be the whole prompt)."""
    for token, prompt in TASK_PROMPTS.items():
        if token in text:
            if text != token:
                raise InvalidRequestError("prompt", f"task token {token} must be the only content of the prompt")
            return prompt
    for token, prompt in TASK_PROMPTS_WITH_INPUT.items():
        if token in text:
            return prompt.format(input=text.replace(token, "").strip())
    return text


# ---- vision tower (DaViT) ------------------------------------------------------------------------

class VisionMLP(nn.Module):
    def __init__(self, vc: Any, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        hidden = int(dim * vc.mlp_ratio)
        self.fc1 = linear(dim, hidden, True, dtype)
        self.fc2 = linear(hidden, dim, True, dtype)
        self.act = get_act_fn(vc.activation_function)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ConvEmbed(nn.Module):
    """Patch embedding of one stage: a strided conv, with a LayerNorm over channels before or after it."""

    def __init__(self, vc: Any, stage: int, dtype: torch.dtype) -> None:
        super().__init__()
        in_ch = vc.in_channels if stage == 0 else vc.embed_dim[stage - 1]
        out_ch = vc.embed_dim[stage]
        self.conv = Conv2d(in_ch, out_ch, vc.patch_size[stage], dtype, stride=vc.patch_stride[stage],
                           padding=vc.patch_padding[stage])
        self.pre_norm = bool(vc.patch_prenorm[stage])
        self.norm = LayerNorm(in_ch if self.pre_norm else out_ch, dtype)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_norm:
            x = self._norm(x)
        x = self.conv(x)
        return x if self.pre_norm else self._norm(x)


class WindowAttention(nn.Module):
    """Multi-head self-attention inside non-overlapping windows (the map is zero-padded to whole
    windows, and the padding takes part in attention, as in transformers)."""

    def __init__(self, vc: Any, stage: int, dtype: torch.dtype) -> None:
        super().__init__()
        dim = vc.embed_dim[stage]
        self.window = vc.window_size
        self.num_heads = vc.num_heads[stage]
        self.head_size = dim // self.num_heads
        self.qkv = linear(dim, 3 * dim, vc.qkv_bias, dtype)
        self.proj = linear(dim, dim, True, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, H, W, C] -> [B, H*W, C]
        b, h, w, c = x.shape
        ws = self.window
        x = F.pad(x, (0, 0, 0, (ws - w % ws) % ws, 0, (ws - h % ws) % ws))
        hp, wp = x.shape[1], x.shape[2]
        x = x.view(b, hp // ws, ws, wp // ws, ws, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, ws * ws, c)
        n, t = x.shape[0], x.shape[1]
        q, k, v = self.qkv(x).view(n, t, 3, self.num_heads, self.head_size).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_size ** -0.5)
        out = self.proj(out.transpose(1, 2).reshape(n, t, c))
        out = out.view(b, hp // ws, wp // ws, ws, ws, c).permute(0, 1, 3, 2, 4, 5).reshape(b, hp, wp, c)
        return out[:, :h, :w].reshape(b, h * w, c)


class ChannelAttention(nn.Module):
    """Attention across channels within each channel group (tokens play the role of the head dim)."""

    def __init__(self, vc: Any, stage: int, dtype: torch.dtype) -> None:
        super().__init__()
        dim = vc.embed_dim[stage]
        self.groups = vc.num_groups[stage]
        self.qkv = linear(dim, 3 * dim, vc.qkv_bias, dtype)
        self.proj = linear(dim, dim, True, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, N, C]
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.groups, c // self.groups).permute(2, 0, 3, 4, 1)  # [B, G, C/G, N]
        out = F.scaled_dot_product_attention(q, k, v, scale=n ** -0.5)
        return self.proj(out.permute(0, 3, 1, 2).reshape(b, n, c))


class _MixingBlock(nn.Module):
    """Depthwise conv (residual), attention (pre-norm, residual), depthwise conv (residual), MLP."""

    def __init__(self, vc: Any, stage: int, dtype: torch.dtype) -> None:
        super().__init__()
        dim = vc.embed_dim[stage]
        self.conv1 = Conv2d(dim, dim, 3, dtype, padding=1, groups=dim)  # depthwise
        self.norm1 = LayerNorm(dim, dtype)
        self.conv2 = Conv2d(dim, dim, 3, dtype, padding=1, groups=dim)
        self.norm2 = LayerNorm(dim, dtype)
        self.ffn = VisionMLP(vc, dim, dtype)

    def attend(self, t: torch.Tensor, h: int, w: int) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, H, W]
        b, c, h, w = x.shape
        x = self.conv1(x) + x
        t = x.flatten(2).transpose(1, 2)
        t = t + self.attend(self.norm1(t), h, w)
        x = t.transpose(1, 2).reshape(b, c, h, w)
        x = self.conv2(x) + x
        t = x.flatten(2).transpose(1, 2)
        t = t + self.ffn(self.norm2(t))
        return t.transpose(1, 2).reshape(b, c, h, w)


class SpatialBlock(_MixingBlock):
    def __init__(self, vc: Any, stage: int, dtype: torch.dtype) -> None:
        super().__init__(vc, stage, dtype)
        self.window_attn = WindowAttention(vc, stage, dtype)

    def attend(self, t: torch.Tensor, h: int, w: int) -> torch.Tensor:
        return self.window_attn(t.view(t.shape[0], h, w, t.shape[-1]))


class ChannelBlock(_MixingBlock):
    def __init__(self, vc: Any, stage: int, dtype: torch.dtype) -> None:
        super().__init__(vc, stage, dtype)
        self.channel_attn = ChannelAttention(vc, stage, dtype)

    def attend(self, t: torch.Tensor, h: int, w: int) -> torch.Tensor:
        return self.channel_attn(t)


class VisionBlock(nn.Module):
    def __init__(self, vc: Any, stage: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.spatial_block = SpatialBlock(vc, stage, dtype)
        self.channel_block = ChannelBlock(vc, stage, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.channel_block(self.spatial_block(x))


class VisionTower(nn.Module):
    def __init__(self, vc: Any, dtype: torch.dtype) -> None:
        super().__init__()
        stages = len(vc.embed_dim)
        if not stages == len(vc.num_heads) == len(vc.num_groups) == len(vc.depths):
            raise ValueError("Florence-2 vision config: embed_dim, num_heads, num_groups and depths must have "
                             "one entry per stage")
        self.convs = nn.ModuleList(ConvEmbed(vc, s, dtype) for s in range(stages))
        self.blocks = nn.ModuleList(nn.ModuleList(VisionBlock(vc, s, dtype) for _ in range(vc.depths[s]))
                                    for s in range(stages))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [B, 3, H, W] -> [B, C, h, w]
        x = pixels.to(self.convs[0].conv.weight.dtype)
        for conv, blocks in zip(self.convs, self.blocks):
            x = conv(x)
            for block in blocks:
                x = block(x)
        return x


class PositionEmbedding2D(nn.Module):
    def __init__(self, vc: Any, dtype: torch.dtype) -> None:
        super().__init__()
        dim = vc.embed_dim[-1]
        self.row_embeddings = Embedding(vc.max_position_embeddings, dim // 2, dtype)
        self.column_embeddings = Embedding(vc.max_position_embeddings, dim - dim // 2, dtype)

    def forward(self, h: int, w: int) -> torch.Tensor:  # [h, w, C]: column embedding, then row embedding
        cols = self.column_embeddings.weight[:w][None, :, :].expand(h, w, -1)
        rows = self.row_embeddings.weight[:h][:, None, :].expand(h, w, -1)
        return torch.cat([cols, rows], dim=-1)


class TemporalEmbedding(nn.Module):
    def __init__(self, vc: Any) -> None:
        super().__init__()
        self.register_buffer("pos_idx_to_embed", sinusoid_table(vc.max_temporal_embeddings, vc.embed_dim[-1]))


class MultiModalProjector(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        vc = config.vision_config
        self.image_projection = linear(vc.embed_dim[-1], vc.projection_dim, False, dtype)
        self.image_proj_norm = LayerNorm(vc.projection_dim, dtype)
        self.image_position_embed = PositionEmbedding2D(vc, dtype)
        self.visual_temporal_embed = TemporalEmbedding(vc)

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # [B, C, h, w] -> [B, 1 + h*w, D]
        b, c, h, w = features.shape
        x = (features.permute(0, 2, 3, 1) + self.image_position_embed(h, w)).reshape(b, h * w, c)
        x = x + self.visual_temporal_embed.pos_idx_to_embed[0].to(x.dtype)  # a single frame: temporal position 0
        x = torch.cat([x.mean(dim=1, keepdim=True), x], dim=1)  # the spatially pooled token, then every position
        return self.image_proj_norm(self.image_projection(x))


class Florence2Model(nn.Module):
    def __init__(self, config: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.vision_tower = VisionTower(config.vision_config, dtype)
        self.multi_modal_projector = MultiModalProjector(config, dtype)
        self.language_model = BartModel(config.text_config, attn_backend, dtype)


# ---- the engine model ----------------------------------------------------------------------------

class Florence2ForConditionalGeneration(nn.Module, SupportsEncoderDecoder, SupportsMultiModal):
    """Engine model for Florence2ForConditionalGeneration checkpoints (image + task prompt in, text out)."""

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = hf_config
        tc = hf_config.text_config
        if hf_config.vision_config.projection_dim != tc.d_model:
            raise ValueError(f"Florence-2 config: vision projection_dim {hf_config.vision_config.projection_dim} "
                             f"must equal the language model's d_model {tc.d_model}")
        self.model = Florence2Model(hf_config, attn_backend, dtype)
        self.num_layers: int = tc.decoder_layers
        self.num_kv_heads: int = tc.decoder_attention_heads
        self.head_size: int = tc.d_model // tc.decoder_attention_heads
        self.vocab_size: int = tc.vocab_size
        self.max_encoder_len: int = tc.max_position_embeddings
        self.tie_word_embeddings = bool(cfg(hf_config, "tie_word_embeddings", True))
        tied = self.model.language_model.shared if self.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(tc.vocab_size, tc.d_model, dtype, tied=tied, ops=TORCH_OPS)

    # ---- prompts --------------------------------------------------------------------------------
    @classmethod
    def get_max_model_len(cls, hf_config: Any) -> int:
        return int(hf_config.text_config.max_position_embeddings)

    @staticmethod
    def num_image_tokens(hf_config: Any, height: int, width: int) -> int:
        vc = hf_config.vision_config
        for k, s, p in zip(vc.patch_size, vc.patch_stride, vc.patch_padding):
            height, width = (height + 2 * p - k) // s + 1, (width + 2 * p - k) // s + 1
        if max(height, width) > vc.max_position_embeddings:
            raise InvalidRequestError("multi_modal_data", f"the image gives a {height}x{width} feature map, larger "
                                      f"than the {vc.max_position_embeddings} learned positions per side")
        return 1 + height * width

    @classmethod
    def process_prompt(cls, prompt: Any, ctx: InputContext) -> ProcessedPrompt:
        """``{"prompt": "<CAPTION>", "multi_modal_data": {"image": PIL.Image}}``: the task token is expanded to its
        prompt text and, with an image, wrapped in the tokenizer's BOS/EOS, as transformers' Florence2Processor
        does; the image goes through the model folder's image processor (transformers' PIL backend). The image
        tokens come first in the encoder's input, then the prompt's tokens. A prompt without an image is
        encoded as text alone. The decoder starts from ``decoder_start_token_id``."""
        c, tc, tok = ctx.hf_config, ctx.hf_config.text_config, ctx.tokenizer
        image = None
        if isinstance(prompt, dict):
            mm = prompt.get("multi_modal_data") or {}
            if not isinstance(mm, dict) or set(mm) - {"image"}:
                raise InvalidRequestError("multi_modal_data", "Florence-2 takes one image: {'image': PIL.Image}")
            image = mm.get("image")
            if isinstance(image, (list, tuple)):
                if len(image) != 1:
                    raise InvalidRequestError("multi_modal_data", f"Florence-2 takes one image per prompt, "
                                                                  f"got {len(image)}")
                image = image[0]
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = text_or_ids(prompt, tok, "prompt", add_special_tokens=False)
        else:
            raw = prompt.get("prompt", "") if isinstance(prompt, dict) else prompt
            if not isinstance(raw, str):
                raise InvalidRequestError("prompt", f"must be a string, got {type(raw).__name__}")
            text = task_prompt(raw)
            if image is not None:
                text = (tok.bos_token or "") + text + (tok.eos_token or "")
            ids = list(tok.encode(text, add_special_tokens=False))
            text = raw
        pixel_values = None
        num_image = 0
        if image is not None:
            try:
                pixel_values = ctx.processor("image_processor")(image, return_tensors="pt")["pixel_values"][0]
            except OSError as e:
                raise InvalidRequestError("multi_modal_data", f"cannot load the model's image processor "
                                          f"(preprocessor_config.json): {e}") from e
            num_image = cls.num_image_tokens(c, int(pixel_values.shape[-2]), int(pixel_values.shape[-1]))
        if num_image + len(ids) > tc.max_position_embeddings:
            raise InvalidRequestError("prompt", f"{num_image} image tokens and {len(ids)} prompt tokens are more "
                                      f"than the encoder's {tc.max_position_embeddings} positions")
        if ids or not num_image:
            check_encoder_ids(ids, tc.vocab_size, tc.max_position_embeddings)
        return ProcessedPrompt(prompt_token_ids=decoder_prompt_ids(None, ctx, tc), prompt=text,
                               encoder_inputs=(pixel_values, ids), num_encoder_tokens=num_image + len(ids))

    # ---- the core's encoder-decoder contract ----------------------------------------------------
    def image_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] -> image tokens [B, 1 + h*w, d_model]."""
        return self.model.multi_modal_projector(self.model.vision_tower(pixels))

    def encode(self, encoder_inputs: list[tuple[torch.Tensor | None, list[int]]]) -> list[torch.Tensor]:
        dev = model_device(self)
        lm = self.model.language_model
        images: dict[int, torch.Tensor] = {}
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i, (pixels, _) in enumerate(encoder_inputs):
            if pixels is not None:
                by_shape.setdefault(tuple(pixels.shape), []).append(i)
        for rows in by_shape.values():  # one vision pass per image size
            feats = self.image_features(torch.stack([encoder_inputs[i][0] for i in rows]).to(dev))
            images.update(zip(rows, feats))
        embeds = []
        for i, (_, ids) in enumerate(encoder_inputs):
            # transformers embeds the prompt with the (scaled) shared table, then puts the image in front.
            text = lm.shared(torch.as_tensor(ids, dtype=torch.long, device=dev)) * lm.embed_scale
            embeds.append(torch.cat([images[i].to(text.dtype), text]) if i in images else text)
        return lm.encoder(embeds)

    def cross_kv(self, encoder_hidden: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.model.language_model.cross_kv(encoder_hidden)

    def get_kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec]:
        return self.model.language_model.kv_cache_specs(block_size, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: list[AttentionMetadata]) -> torch.Tensor:
        return self.model.language_model.decode(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states).float()

    # ---- weights --------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def rename(name: str) -> str | None:
            if name == "lm_head.weight" and self.tie_word_embeddings:
                return None
            return name

        return load_hf_weights(self, weights, rename=rename, stacked=STACKED,
                               buffers=("model.multi_modal_projector.visual_temporal_embed.pos_idx_to_embed",))
