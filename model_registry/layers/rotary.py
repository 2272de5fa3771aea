"""Rotary position embeddings with the scaling variants transformers supports for Llama.

Frequencies follow transformers' rope init functions (``modeling_rope_utils``)
so logits match Hugging Face. cos/sin are precomputed per position in float32
(the same arithmetic as HF's per-forward computation, so bit-identical) and
looked up by position id, which is what paged, flattened batches need.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from vllite_core.errors import ConfigError
from vllite_core.model_ops import ModelOps

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def rope_parameters(hf_config: Any, layer_type: str = "full_attention") -> dict[str, Any]:
    """The RoPE parameters of a config, whichever way it stores them.

    transformers 5 keeps them in ``config.rope_parameters`` (with ``rope_theta``
    inside), per layer type where layer kinds differ (Gemma 3: ``sliding_attention``
    and ``full_attention``; ``layer_type`` picks one); older configs have
    ``rope_theta`` and ``rope_scaling`` attributes.
    """
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and "full_attention" in params and isinstance(params["full_attention"], dict):
        params = params.get(layer_type) or params["full_attention"]  # per-layer-type layout
    params = dict(params or {})
    legacy = getattr(hf_config, "rope_scaling", None)
    if isinstance(legacy, dict):
        for k, v in legacy.items():
            params.setdefault(k, v)
    if "rope_type" not in params:
        params["rope_type"] = params.pop("type", "default") or "default"
    if params["rope_type"] == "mrope":  # Qwen2-VL's legacy name: default frequencies, sections (MRotaryEmbedding)
        params["rope_type"] = "default"
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(hf_config, "rope_theta", None) or 10000.0
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        # Like transformers: a top-level original_max_position_embeddings wins, else the trained length.
        top_level = getattr(hf_config, "original_max_position_embeddings", None)
        if top_level:
            params["original_max_position_embeddings"] = top_level
        params.setdefault("original_max_position_embeddings", getattr(hf_config, "max_position_embeddings", 2048))
    return params


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))


def _llama3_inv_freq(base: float, dim: int, p: dict[str, Any]) -> torch.Tensor:
    inv_freq = _base_inv_freq(base, dim)
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by the factor, short ones kept, the middle band blended.
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, blended, scaled)


def _yarn_inv_freq(base: float, dim: int, p: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    original = p.get("original_max_position_embeddings") or max_pos
    factor = p.get("factor") or max_pos / original
    attention_factor = p.get("attention_factor")
    mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_weight = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq, float(attention_factor)


def _longrope_inv_freq(base: float, dim: int, p: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                        float]:
    """Phi-3's LongRoPE: (short, long) frequencies, each divided by its per-frequency factors, and the attention
    factor (from the ratio of the extended and the original lengths unless given)."""
    original = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_pos / original
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    short, long = (1.0 / (torch.tensor(p[k], dtype=torch.float32) * base ** shape)
                   for k in ("short_factor", "long_factor"))
    return short, long, float(attention_factor)


def rotary_dim_of(hf_config: Any, head_size: int) -> int:
    """The rotating columns of a head: ``partial_rotary_factor`` of it (in the rope parameters or the config)."""
    factor = rope_parameters(hf_config).get("partial_rotary_factor") or getattr(
        hf_config, "partial_rotary_factor", None) or 1.0
    return int(head_size * float(factor))


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables indexed by position; ``lookup`` once per step, ``ModelOps.rotary`` in every layer.
    ``rotary_dim``: the leading columns of each head that rotate (partial rotary; the head size by default,
    ``apply_rotary`` rotates them); ``base``: a rope base of this table's own (a layer kind with its own
    frequencies), else the config's ``rope_theta``; ``layer_type``: which per-layer-type parameters to take.

    ``dynamic`` and ``longrope`` tables change frequencies past a length (the trained one; LongRoPE's original
    one, short factors before it and long ones from it): a position's row is what transformers computes for a
    sequence that reaches it, so generation from a prompt shorter than that length matches HF's ``generate``."""

    def __init__(self, hf_config: Any, head_size: int, rotary_dim: int | None = None,
                 base: float | None = None, layer_type: str = "full_attention") -> None:
        super().__init__()
        head_size = rotary_dim or head_size  # the tables cover the rotating columns only
        p = rope_parameters(hf_config, layer_type)
        if base is not None:
            p["rope_theta"] = base
        self.rope_type = str(p["rope_type"])
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(f"rope_parameters.rope_type {self.rope_type!r} is not supported (supported: "
                              f"{', '.join(SUPPORTED_ROPE_TYPES)})")
        needed = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
                  "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
                  "longrope": ("short_factor", "long_factor")}.get(self.rope_type, ())
        missing = [k for k in needed if p.get(k) is None and not (k == "factor" and self.rope_type == "yarn")]
        if missing:
            raise ConfigError(f"rope_parameters of rope_type {self.rope_type!r} lack {', '.join(missing)}")
        self.params = p
        self.head_size = head_size
        self.base = float(p["rope_theta"])
        self.max_position_embeddings = int(getattr(hf_config, "max_position_embeddings", 2048) or 2048)
        self.attention_scaling = 1.0
        self._split_at: int | None = self.max_position_embeddings if self.rope_type == "dynamic" else None
        if self.rope_type == "longrope":
            for k in ("short_factor", "long_factor"):
                if len(p[k]) != head_size // 2:
                    raise ConfigError(f"rope_parameters.{k} has {len(p[k])} values, the rotary dimension "
                                      f"{head_size} needs {head_size // 2}")
            inv_freq, self._long_inv_freq, self.attention_scaling = _longrope_inv_freq(
                self.base, head_size, p, self.max_position_embeddings)
            self._split_at = int(p["original_max_position_embeddings"])
        elif self.rope_type in ("default", "dynamic"):
            inv_freq = _base_inv_freq(self.base, head_size)
        elif self.rope_type == "linear":
            inv_freq = _base_inv_freq(self.base, head_size) / p["factor"]
        elif self.rope_type == "llama3":
            inv_freq = _llama3_inv_freq(self.base, head_size, p)
        else:
            inv_freq, self.attention_scaling = _yarn_inv_freq(self.base, head_size, p, self.max_position_embeddings)
        self.inv_freq = inv_freq
        self.register_buffer("cos_cache", torch.empty(0, head_size), persistent=False)
        self.register_buffer("sin_cache", torch.empty(0, head_size), persistent=False)
        self.ensure_positions(self.max_position_embeddings)

    def _inv_freq_beyond(self) -> torch.Tensor:
        """LongRoPE's long frequencies, or dynamic (NTK) frequencies past max_position_embeddings.

        transformers recomputes them per batch from the longest sequence; a paged
        engine needs one table, so positions beyond the trained length use the
        frequencies for the full extended length (max_position_embeddings * factor),
        as vLLM does. Within the trained length they equal transformers' exactly.
        """
        if self.rope_type == "longrope":
            return self._long_inv_freq
        factor, dim, max_pos = self.params["factor"], self.head_size, self.max_position_embeddings
        seq_len = max_pos * factor
        base = self.base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(base, dim)

    def _table(self, start: int, end: int, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, end, dtype=torch.int64, device=self.cos_cache.device).float()
        freqs = pos[:, None] * inv_freq.to(pos.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    def ensure_positions(self, n: int) -> None:
        """Make the tables cover positions ``0..n-1`` (grows them; never shrinks)."""
        have = self.cos_cache.shape[0]
        if n <= have:
            return
        n = max(n, 2 * have)
        parts = []
        split = min(max(have, self._split_at), n) if self._split_at is not None else n
        if split > have:
            parts.append(self._table(have, split, self.inv_freq))
        if n > split:
            parts.append(self._table(split, n, self._inv_freq_beyond()))
        self.cos_cache = torch.cat([self.cos_cache] + [c for c, _ in parts])
        self.sin_cache = torch.cat([self.sin_cache] + [s for _, s in parts])

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each position, [T, head_size] (once per step, shared by every layer)."""
        if positions.device.type == "cpu" and positions.numel():
            # Free on the CPU; accelerators call ensure_positions(max_model_len) up front instead (no sync).
            self.ensure_positions(int(positions.max()) + 1)
        return self.cos_cache.index_select(0, positions).to(dtype), self.sin_cache.index_select(0, positions).to(dtype)



def apply_rotary(ops: ModelOps, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` [T, H, D] and ``k`` [T, Hkv, D] by tables of ``cos.shape[-1]`` columns: all of each head, or
    its leading columns (partial rotary, the rest passed through)."""
    rd = cos.shape[-1]
    if rd == q.shape[-1]:
        return ops.rotary(q, k, cos, sin)
    qr, kr = ops.rotary(q[..., :rd], k[..., :rd], cos, sin)
    return torch.cat((qr, q[..., rd:]), dim=-1), torch.cat((kr, k[..., rd:]), dim=-1)


def apply_rotary_interleaved(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-J style rotation (GLM-4): column pairs (2i, 2i+1) rotate together by frequency i, over the leading
    ``cos.shape[-1]`` columns of each head (the tables' halves repeat each frequency: the first half is used)."""
    rd = cos.shape[-1]
    c = cos[:, None, : rd // 2].repeat_interleave(2, dim=-1)
    s = sin[:, None, : rd // 2].repeat_interleave(2, dim=-1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xr = x[..., :rd]
        half = torch.stack((-xr[..., 1::2], xr[..., 0::2]), dim=-1).flatten(-2)
        return torch.cat((xr * c + half * s, x[..., rd:]), dim=-1)

    return rotate(q), rotate(k)


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal RoPE (Qwen2-VL): a token has three positions (temporal, height, width); the rotary columns are
    split in ``mrope_section`` bands, band i rotating by position i % 3. ``lookup`` takes [3, T] positions, or [T]
    when all three are equal (text, and every token after the prompt), which is plain RoPE."""

    def __init__(self, hf_config: Any, head_size: int, mrope_section: list[int]) -> None:
        super().__init__(hf_config, head_size)
        if sum(mrope_section) != head_size // 2:
            raise ValueError(f"mrope_section {mrope_section} must sum to head_size / 2 = {head_size // 2}")
        half = torch.cat([torch.full((n,), i % 3, dtype=torch.int64) for i, n in enumerate(mrope_section)])
        self.register_buffer("axis", torch.cat([half, half]), persistent=False)  # column -> its position's axis

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().lookup(positions, dtype)
        if positions.device.type == "cpu" and positions.numel():
            self.ensure_positions(int(positions.max()) + 1)
        t = positions.shape[1]
        index = self.axis.view(1, 1, -1).expand(1, t, -1)

        def pick(table: torch.Tensor) -> torch.Tensor:
            return table[positions].gather(0, index).squeeze(0).to(dtype)  # [3, T, D] -> [T, D]

        return pick(self.cos_cache), pick(self.sin_cache)
