"""Mistral 3 with images: the Pixtral vision encoder (patch conv, RMSNorm, pre-norm blocks with a gated MLP and
axial 2D rotary positions over each image's own patch grid, any size), a projector (RMSNorm, a learned merge of
each ``spatial_merge_size`` x ``spatial_merge_size`` block of patches, two linears), and the Mistral decoder.

An image is written ``[IMG]`` in a prompt. As transformers' PixtralProcessor does, it becomes, per row of merged
patches, ``[IMG]`` per column then ``[IMG_BREAK]``, the last break replaced by ``[IMG_END]``. The whole run is
one multimodal item: its rows are the image's embeddings at ``[IMG]`` positions and the text embeddings of
``[IMG_BREAK]`` / ``[IMG_END]`` where those stand, so one cached entry covers the image.
"""
from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model_registry.layers import ShardsByHeads, copy_checked, empty_param, get_act_fn
from model_registry.models.language_model_shell import LanguageModelShell
from model_registry.models.llama import LlamaForCausalLM
from model_registry.models.mm_prompt import image_processor, placeholder_prompt
from vllite_core.attention.backend import AttentionBackend
from vllite_core.errors import ConfigError, InvalidRequestError
from vllite_core.inputs import InputContext, ProcessedPrompt
from vllite_core.model_interfaces import SupportsMultiModalDecoder
from vllite_core.multimodal.features import MultiModalFeature
from vllite_core.multimodal.images import hash_image


def feature_layer(layers: int | list[int]) -> int:
    """The one hidden-state index the tower's features come from: an int, or a list of one as transformers takes.
    Several layers are refused: transformers concatenates their features, but the projector's norm and patch
    merger are sized for one layer's width, so its own class fails on such a config too."""
    if isinstance(layers, int):
        return layers
    if len(layers) != 1:
        raise ConfigError(f"vision_feature_layer {list(layers)}: Mistral 3's projector (norm and patch merger "
                          f"sized for one layer's features) takes exactly one layer")
    return int(layers[0])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class PixtralLayer(nn.Module):
    def __init__(self, c: Any, dtype: torch.dtype) -> None:
        super().__init__()
        d = c.hidden_size
        self.heads, self.head_dim = c.num_attention_heads, d // c.num_attention_heads
        for name, (i, o) in {"q_proj": (d, d), "k_proj": (d, d), "v_proj": (d, d), "o_proj": (d, d),
                             "gate_proj": (d, c.intermediate_size), "up_proj": (d, c.intermediate_size),
                             "down_proj": (c.intermediate_size, d)}.items():
            setattr(self, name, empty_param(o, i, dtype=dtype))
        self.attention_norm = empty_param(d, dtype=dtype)
        self.ffn_norm = empty_param(d, dtype=dtype)
        self.act = get_act_fn(str(c.hidden_act))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        h = rms_norm(x, self.attention_norm, 1e-5)
        q, k, v = ((h @ w.t()).view(n, self.heads, self.head_dim).transpose(0, 1)
                   for w in (self.q_proj, self.k_proj, self.v_proj))
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        ctx = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim ** -0.5).transpose(0, 1).reshape(n, -1)
        x = x + ctx @ self.o_proj.t()
        h = rms_norm(x, self.ffn_norm, 1e-5)
        return x + (self.act(h @ self.gate_proj.t()) * (h @ self.up_proj.t())) @ self.down_proj.t()


class PixtralVisionTower(nn.Module):
    def __init__(self, c: Any, num_layers: int, dtype: torch.dtype) -> None:
        super().__init__()
        d = c.hidden_size
        self.patch_size = c.patch_size
        self.patch_conv = empty_param(d, c.num_channels, c.patch_size, c.patch_size, dtype=dtype)
        self.ln_pre = empty_param(d, dtype=dtype)
        self.layers = nn.ModuleList(PixtralLayer(c, dtype) for _ in range(num_layers))
        head = d // c.num_attention_heads
        theta = float(c.rope_parameters["rope_theta"])
        inv = 1.0 / (theta ** (torch.arange(0, head, 2, dtype=torch.float) / head))
        self.inv_h, self.inv_w = inv[0::2], inv[1::2]  # rows rotate by the even frequencies, columns by the odd

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """One image [3, H, W] -> the chosen layer's states [patches, d], row-major over its patch grid."""
        x = F.conv2d(pixels[None].to(self.patch_conv.dtype), self.patch_conv, stride=self.patch_size)[0]
        gh, gw = x.shape[-2:]
        x = rms_norm(x.flatten(1).t(), self.ln_pre, 1e-5)
        rows = torch.arange(gh, dtype=torch.float).repeat_interleave(gw)
        cols = torch.arange(gw, dtype=torch.float).repeat(gh)
        angles = torch.cat((rows[:, None] * self.inv_h, cols[:, None] * self.inv_w), dim=-1)
        angles = torch.cat((angles, angles), dim=-1).to(x.device)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x


class Mistral3ForConditionalGeneration(LanguageModelShell, nn.Module, ShardsByHeads, SupportsMultiModalDecoder):
    """Tensor-parallel: the language model is sharded (its heads must split); the Pixtral tower and the projector
    (replicated layers) run whole on every rank, so each rank computes the same image embeddings."""

    tp_sub_config = "text_config"
    supported_modalities = ("image",)

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = hf_config
        vc, tc = hf_config.vision_config, copy.copy(hf_config.get_text_config())
        # the top-level config says whether the LM head is the embedding (transformers ties by it)
        tc.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", tc.tie_word_embeddings))
        layer = feature_layer(hf_config.vision_feature_layer)
        n = vc.num_hidden_layers
        self.vision_tower = PixtralVisionTower(vc, layer % (n + 1), dtype)  # hidden state i = after i layers
        d, t, self.merge = vc.hidden_size, tc.hidden_size, int(hf_config.spatial_merge_size)
        bias = bool(hf_config.multimodal_projector_bias)
        self.proj_norm = empty_param(d, dtype=dtype)
        self.proj_eps = float(tc.rms_norm_eps)
        self.merging_layer = empty_param(d, d * self.merge ** 2, dtype=dtype)
        self.linear_1 = nn.Linear(d, t, bias=bias, dtype=dtype)
        self.linear_2 = nn.Linear(t, t, bias=bias, dtype=dtype)
        self.act = get_act_fn(str(hf_config.projector_hidden_act))
        self.language_model = LlamaForCausalLM(tc, attn_backend, dtype)
        self.image_id = int(hf_config.image_token_id)
        self.vocab_size: int = tc.vocab_size
        self.dtype = dtype

    # ---- prompts -----------------------------------------------------------------------------------
    @classmethod
    def process_prompt(cls, prompt: Any, ctx: InputContext) -> ProcessedPrompt:
        """``[IMG]`` per image in the text (or ``prompt_token_ids``), expanded to the image's grid of merged
        patches with row breaks, as the processor does; pixels at the size the folder's image processor picks."""
        c, tok = ctx.hf_config, ctx.tokenizer
        image_id = cls.image_token_id(c)
        text, ids, images = placeholder_prompt(prompt, ctx, image_id, cls.supported_modalities)
        if not images:
            return ProcessedPrompt(prompt_token_ids=ids, prompt=text)
        step = int(c.vision_config.patch_size) * int(c.spatial_merge_size)
        brk, end = tok.convert_tokens_to_ids("[IMG_BREAK]"), tok.convert_tokens_to_ids("[IMG_END]")
        out: list[int] = []
        features: list[MultiModalFeature] = []
        it = iter(images)
        for t in ids:
            if t != image_id:
                out.append(t)
                continue
            img = next(it)
            proc = image_processor(ctx)([img], patch_size=step, return_tensors="pt")
            h, w = (int(v) for v in proc["image_sizes"][0])
            if h % step or w % step or h == 0 or w == 0:
                raise InvalidRequestError("multi_modal_data", f"the image processor gives a {h}x{w} image, not a "
                                          f"grid of {step}-pixel blocks")
            run = ([image_id] * (w // step) + [brk]) * (h // step)
            run[-1] = end
            features.append(MultiModalFeature("image", hash_image(img), len(out), len(run),
                                              (proc["pixel_values"][0, :, :h, :w], torch.tensor(run))))
            out.extend(run)
        return ProcessedPrompt(prompt_token_ids=out, prompt=text, mm_features=features)

    # ---- the engine's model contract ---------------------------------------------------------------
    def _merge(self, x: torch.Tensor, gh: int, gw: int) -> torch.Tensor:
        """Each merge x merge block of the [gh*gw, d] grid into one row (unfold's channel-major order)."""
        d, m = x.shape[-1], self.merge
        grid = F.unfold(x.view(gh, gw, d).permute(2, 0, 1)[None], kernel_size=m, stride=m)
        return grid.view(d * m * m, -1).t() @ self.merging_layer.t()

    @torch.inference_mode()
    def embed_multimodal(self, items: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """Per image, the rows of its whole placeholder run: projected merged patches at ``[IMG]``, the text
        embedding at ``[IMG_BREAK]`` / ``[IMG_END]``."""
        out = []
        dev = self.proj_norm.device
        for pixels, run in items:
            run = run.to(dev)
            states = self.vision_tower(pixels.to(dev, self.dtype))
            p = self.vision_tower.patch_size
            gh, gw = pixels.shape[-2] // p, pixels.shape[-1] // p
            merged = self._merge(rms_norm(states, self.proj_norm, self.proj_eps), gh, gw)
            rows = self.embed_input_ids(run).clone()
            rows[run == self.image_id] = self.linear_2(self.act(self.linear_1(merged))).to(rows.dtype)
            out.append(rows)
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF names, new (``model.vision_tower.*``, ``model.language_model.*``) or old (``language_model.model.*``)."""
        text: list[tuple[str, torch.Tensor]] = []
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        n_layers = len(self.vision_tower.layers)
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name.startswith("vision_tower."):
                sub = name.removeprefix("vision_tower.").replace("transformer.layers.", "layers.")
                sub = sub.replace(".attention.", ".").replace(".feed_forward.", ".").replace(".weight", "")
                if sub.startswith("layers.") and int(sub.split(".")[1]) >= n_layers:
                    continue  # past the feature layer: never run
                target = "vision_tower." + sub
            elif name.startswith("multi_modal_projector."):
                sub = name.removeprefix("multi_modal_projector.")
                renamed = {"norm.weight": "proj_norm", "patch_merger.merging_layer.weight": "merging_layer"}
                target = renamed.get(sub, sub)
            elif name.startswith("language_model."):
                sub = name.removeprefix("language_model.")
                text.append((sub if sub.startswith(("model.", "lm_head")) else "model." + sub, tensor))
                continue
            elif name.startswith("lm_head."):
                text.append((name, tensor))
                continue
            else:
                raise ValueError(f"checkpoint has weights this model does not know: {name}")
            if target not in params:
                raise ValueError(f"checkpoint has weights this model does not know: {name}")
            copy_checked(params[target].data, tensor, name)
            loaded.add(target)
        loaded |= {"language_model." + n for n in self.language_model.load_weights(text)}
        return loaded
