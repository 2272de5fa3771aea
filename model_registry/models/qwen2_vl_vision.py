"""The Qwen2-VL and Qwen2.5-VL vision transformers, written for the engine.

An image arrives as its processor's patches ([t*h*w, C*2*P*P]: two frames per temporal patch, a still image
repeated) and its grid (t, h, w). Patches are embedded by one matmul (a Conv3d whose stride is its kernel), run
through blocks with 2D rotary positions (height and width bands), attending only within their image (Qwen2.5-VL:
within windows of merged patches except in the full-attention layers), and every merge x merge patches are
merged into one embedding of the text width. Images of one step are packed along the token axis.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model_registry.layers import TORCH_OPS, LayerNorm, RMSNorm, get_act_fn
from model_registry.models.clip import linear


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotary in float32 on [heads, N, D] with [N, D] tables."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = linear(dim, 3 * dim, dtype)
        self.proj = linear(dim, dim, dtype)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cu: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).permute(1, 2, 0, 3).unbind(0)  # [heads, n, D] each
        q, k, v = _rotate(q, *rope), _rotate(k, *rope), v.contiguous()
        out = torch.empty_like(q)
        for a, b in zip(cu[:-1], cu[1:]):  # bidirectional, within one image (or window)
            out[:, a:b] = F.scaled_dot_product_attention(q[None, :, a:b], k[None, :, a:b], v[None, :, a:b])[0]
        return self.proj(out.transpose(0, 1).reshape(n, -1))


class VisionMLP(nn.Module):
    """Qwen2-VL: fc1, act, fc2. Qwen2.5-VL: act(gate) * up, down (all with bias)."""

    def __init__(self, dim: int, hidden: int, act: str, gated: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.gated = gated
        self.act = get_act_fn(act)
        if gated:
            self.gate_proj, self.up_proj = linear(dim, hidden, dtype), linear(dim, hidden, dtype)
            self.down_proj = linear(hidden, dim, dtype)
        else:
            self.fc1, self.fc2 = linear(dim, hidden, dtype), linear(hidden, dim, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_hidden: int, act: str, v25: bool, dtype: torch.dtype) -> None:
        super().__init__()
        norm = (lambda: RMSNorm(dim, 1e-6, dtype, ops=TORCH_OPS)) if v25 else (lambda: LayerNorm(dim, dtype, 1e-6))
        self.norm1, self.norm2 = norm(), norm()
        self.attn = VisionAttention(dim, num_heads, dtype)
        self.mlp = VisionMLP(dim, mlp_hidden, act, v25, dtype)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cu: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, cu)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """merge x merge neighbouring patches (adjacent in the processor's order) -> one text-width embedding."""

    def __init__(self, dim: int, out_dim: int, merge: int, v25: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.width = dim * merge * merge
        self.ln_q = RMSNorm(dim, 1e-6, dtype, ops=TORCH_OPS) if v25 else LayerNorm(dim, dtype, 1e-6)
        self.mlp = nn.ModuleList([linear(self.width, self.width, dtype), nn.GELU(), linear(self.width, out_dim, dtype)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_q(x).view(-1, self.width)
        for layer in self.mlp:
            x = layer(x)
        return x


def patch_positions(grids: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """(row, column) of every patch, in the processor's order (merge x merge blocks, row-major), [N, 2]."""
    out = []
    for t, h, w in grids:
        hh = torch.arange(h).view(h, 1).expand(h, w)
        ww = torch.arange(w).view(1, w).expand(h, w)
        block = (h // merge, merge, w // merge, merge)
        hw = torch.stack([hh.reshape(block).transpose(1, 2).flatten(), ww.reshape(block).transpose(1, 2).flatten()],
                         dim=-1)
        out.append(hw.repeat(t, 1))
    return torch.cat(out)


def window_order(grids: list[tuple[int, int, int]], merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's windows: a permutation of the merged units that makes each window (``window`` x ``window``
    merged units, fewer at the right and bottom edges) contiguous, and the windows' boundaries in patches."""
    order: list[torch.Tensor] = []
    bounds = [0]
    base = 0
    unit = merge * merge
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        index = torch.arange(t * gh * gw).view(t, gh, gw)
        for f in range(t):
            for r in range(0, gh, window):
                for c in range(0, gw, window):
                    cells = index[f, r:r + window, c:c + window].flatten()
                    order.append(cells + base)
                    bounds.append(bounds[-1] + cells.numel() * unit)
        base += t * gh * gw
    return torch.cat(order), bounds


class Qwen2VisionTransformer(nn.Module):
    """Both generations: ``v25`` selects RMSNorm, the gated MLP and window attention (Qwen2.5-VL)."""

    def __init__(self, vc: Any, v25: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.v25 = v25
        dim = vc.hidden_size if v25 else vc.embed_dim
        out_dim = vc.out_hidden_size if v25 else vc.hidden_size
        mlp_hidden = vc.intermediate_size if v25 else int(dim * vc.mlp_ratio)
        self.dim, self.num_heads = dim, vc.num_heads
        self.merge = vc.spatial_merge_size
        self.patch_dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
        self.patch_embed = linear(self.patch_dim, dim, dtype, bias=False)
        self.blocks = nn.ModuleList(VisionBlock(dim, vc.num_heads, mlp_hidden, vc.hidden_act, v25, dtype)
                                    for _ in range(vc.depth))
        self.merger = PatchMerger(dim, out_dim, self.merge, v25, dtype)
        self.full_attention = set(getattr(vc, "fullatt_block_indexes", None) or []) if v25 else None
        self.window = vc.window_size // self.merge // vc.patch_size if v25 else 0
        theta = float((getattr(vc, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        spatial = (dim // vc.num_heads) // 2
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))

    def _rope(self, grids: list[tuple[int, int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = patch_positions(grids, self.merge).to(device)[..., None].float() * self.inv_freq.to(device)
        hw = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        emb = torch.cat([hw, hw], dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Packed patches of several images -> their merged embeddings, packed the same way."""
        x = self.patch_embed(patches.to(self.patch_embed.weight.dtype))
        cos, sin = self._rope(grids, x.device)
        cu = [0]  # each frame of each image attends to itself
        for t, h, w in grids:
            for _ in range(t):
                cu.append(cu[-1] + h * w)
        order, windows = None, cu
        if self.v25:
            order, windows = window_order(grids, self.merge, self.window)
            unit = self.merge * self.merge

            def permute(a: torch.Tensor) -> torch.Tensor:
                return a.view(-1, unit, a.shape[-1])[order.to(a.device)].reshape(a.shape)

            x, cos, sin = permute(x), permute(cos), permute(sin)
        for i, block in enumerate(self.blocks):
            full = order is None or i in self.full_attention
            x = block(x, (cos, sin), cu if full else windows)
        out = self.merger(x)
        if order is not None:
            out = out[torch.argsort(order).to(out.device)]
        return out

    def load(self, weights: Iterable[tuple[str, torch.Tensor]], copy) -> set[str]:
        """HF names below ``visual.``; the Conv3d patch kernel is flattened into the patch matmul."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name == "patch_embed.proj.weight":
                name, tensor = "patch_embed.weight", tensor.reshape(tensor.shape[0], -1)
            if name not in params:
                raise ValueError(f"checkpoint has vision weights this model does not know: visual.{name}")
            copy(params[name].data, tensor, "visual." + name)
            loaded.add(name)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"checkpoint lacks vision weights: {', '.join(sorted(missing)[:6])}")
        return loaded
