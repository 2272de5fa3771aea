"""The dense decoder families beyond Llama (Qwen3, OLMo 2, Granite, GLM-4, Phi-3, Gemma 2 and 3, ...) as one
decoder built from the shared layers, configured by a ``DenseSpec`` each family's file derives from its config.

What differs between these families is a handful of switches, not new layers: which norms a layer has and
where (pre-norm, post-norm, both), q/k norms per head or over all heads, the norm form (``w`` or ``1 + w``), the
activation, the rotary style and width, per-layer windows and rope tables (or none: NoPE layers), and scalars
(attention scale and soft-cap, embedding / residual / logit multipliers, the final logit soft-cap). Checkpoint
names load as they are: each norm module carries its family's checkpoint name. The causal-LM shell (LoRA
targets, tensor parallelism, checkpoint loading) is the Llama one's.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from model_registry.layers import (
    Attention,
    DecoderLayerRecord,
    GatedMLP,
    GemmaRMSNorm,
    NormRecord,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    apply_rotary,
)
from model_registry.layers.params import check_full, copy_checked, empty_param
from model_registry.layers.pipeline import StageLayers
from model_registry.layers.rotary import apply_rotary_interleaved
from model_registry.models.llama import LlamaForCausalLM, _layer_windows
from vllite_core.attention.backend import AttentionBackend, AttentionMetadata
from vllite_core.distributed import get_tp
from vllite_core.distributed.pipeline import IntermediateTensors
from vllite_core.errors import ConfigError
from vllite_core.model_ops import current_model_ops

Role = Literal["attn_in", "attn_out", "mlp_in", "mlp_out"]
PRE_NORM: dict[Role, str] = {"attn_in": "input_layernorm", "mlp_in": "post_attention_layernorm"}


def need(hf_config: Any, name: str, family: str) -> Any:
    """A config field the family cannot run without: a ConfigError naming it when the checkpoint lacks it."""
    value = getattr(hf_config, name, None)
    if value is None:
        raise ConfigError(f"{family}: config.json lacks {name!r}, which this architecture needs")
    return value


@dataclass(frozen=True)
class DenseSpec:
    """One family's switches. ``norms``: role -> checkpoint module name (``attn_in``/``mlp_in`` normalise a
    sublayer's input, ``attn_out``/``mlp_out`` its output before the residual add); ``qk_norm``: ``head`` (over
    each head's columns) or ``all`` (over the whole q / k projection); ``rope_kinds[i]``: the rope table layer i
    uses (a key of ``rope_bases``), or None (no positional rotation, a NoPE layer); ``rope_bases``: kind -> the
    per-layer-type parameters' name and an overriding base (None: the config's)."""

    family: str
    num_layers: int
    head_size: int
    windows: list[int | None]
    rope_kinds: list[str | None]
    norms: dict[Role, str] = field(default_factory=lambda: dict(PRE_NORM))
    norm: Literal["rms", "gemma"] = "rms"
    eps: float = 1e-6
    qk_norm: Literal["head", "all"] | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    activation: str = "silu"
    rope_style: Literal["neox", "interleaved"] = "neox"
    rotary_dim: int | None = None
    rope_bases: dict[str, tuple[str, float | None]] = field(
        default_factory=lambda: {"full_attention": ("full_attention", None)})
    attn_scale: float | None = None
    attn_soft_cap: float | None = None
    embed_scale: float | None = None  # multiplies the token embeddings (Gemma: sqrt(hidden), rounded to the dtype)
    embed_scale_in_dtype: bool = False
    residual_multiplier: float | None = None  # scales what each sublayer adds (Granite; set even when 1.0)
    logits_divisor: float = 1.0
    final_soft_cap: float | None = None

    def check(self) -> None:
        if len(self.windows) != self.num_layers or len(self.rope_kinds) != self.num_layers:
            raise ConfigError(f"{self.family}: layer_types lists {len(self.windows)} layers, "
                              f"num_hidden_layers is {self.num_layers}")


def standard_spec(c: Any, family: str, **overrides: Any) -> DenseSpec:
    """A spec with what every family reads the same way: layers, head size, windows, eps, one rope table."""
    num_layers = int(need(c, "num_hidden_layers", family))
    heads = int(need(c, "num_attention_heads", family))
    head_size = getattr(c, "head_dim", None) or int(need(c, "hidden_size", family)) // heads
    layer_types = getattr(c, "layer_types", None)
    if layer_types is not None and len(layer_types) < num_layers:
        raise ConfigError(f"{family}: layer_types lists {len(layer_types)} layers, num_hidden_layers is {num_layers}")
    base: dict[str, Any] = dict(
        family=family, num_layers=num_layers, head_size=int(head_size), windows=_layer_windows(c, num_layers),
        rope_kinds=["full_attention"] * num_layers, eps=float(getattr(c, "rms_norm_eps", None) or 1e-6))
    base.update(overrides)
    spec = DenseSpec(**base)
    spec.check()
    return spec


class AllHeadsRMSNorm(nn.Module):
    """RMSNorm over a whole q or k projection (OLMo 2), whose heads may be split over ranks: the mean square is
    summed over ranks (ranks holding a replicated KV head count it once each, as they all hold the same share).
    Computed as OLMo 2 does: normalised and scaled in float32, then cast back."""

    def __init__(self, full: int, start: int, local: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.full, self.start, self.eps = full, start, eps
        self.weight = empty_param(local, dtype=dtype)
        self.weight.weight_loader = self.load  # type: ignore[attr-defined]
        self.tp = get_tp()

    @torch.no_grad()
    def load(self, param: torch.Tensor, src: torch.Tensor, shard: str | None, name: str) -> None:
        check_full(src, 0, self.full, name)
        copy_checked(param.data, src[self.start:self.start + param.shape[0]], name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        if self.tp.world_size == 1:
            var = h.pow(2).mean(-1, keepdim=True)
        else:
            var = self.tp.communicator.all_reduce(h.pow(2).sum(-1, keepdim=True)) / (h.shape[-1] * self.tp.world_size)
        return (self.weight.float() * (h * torch.rsqrt(var + self.eps))).to(x.dtype)


def fused_path_reason(s: DenseSpec, rope_kind: str | None) -> str | None:
    """Why a layer of this spec cannot take a platform's fused decoder layer (which computes Llama's: pre-norms
    only, RMSNorm, SiLU, full neox rotary, no soft-cap, no multiplier), or None when it can."""
    why = next((why for bad, why in (
        (set(s.norms) != {"attn_in", "mlp_in"}, "it has post-sublayer norms"),
        (s.norm != "rms", "its norms are the (1 + w) form"),
        (s.qk_norm is not None, "it normalises q and k"),
        (s.activation != "silu", f"its activation is {s.activation}"),
        (rope_kind is None, "it has no rotary embedding (NoPE layer)"),
        (s.rope_style != "neox" or (s.rotary_dim or s.head_size) != s.head_size,
         "its rotary is partial or interleaved"),
        (s.attn_soft_cap is not None, "its attention logits are soft-capped"),
        (s.residual_multiplier is not None, "its residual adds are scaled"),
    ) if bad), None)
    return f"{s.family}: {why} (the fused layer computes Llama's)" if why else None


def _norm(spec: DenseSpec, size: int, dtype: torch.dtype) -> nn.Module:
    return GemmaRMSNorm(size, spec.eps, dtype) if spec.norm == "gemma" else RMSNorm(size, spec.eps, dtype)


class DenseAttention(nn.Module):
    """q/k/v in one matmul (separate or stacked in the checkpoint), optional q/k norms, rotary (neox or
    interleaved, full or partial, or none), paged attention with its window, scale and soft-cap, o_proj."""

    def __init__(self, c: Any, spec: DenseSpec, attn_backend: AttentionBackend, dtype: torch.dtype,
                 window: int | None) -> None:
        super().__init__()
        num_heads = int(c.num_attention_heads)
        num_kv_heads = int(getattr(c, "num_key_value_heads", None) or num_heads)
        self.head_size = d = spec.head_size
        self.qkv_proj = QKVParallelLinear(c.hidden_size, d, num_heads, num_kv_heads, spec.qkv_bias, dtype)
        heads = self.qkv_proj.heads
        self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self._head_split = [self.num_heads, self.num_kv_heads, self.num_kv_heads]
        q_cols = (heads.q_start * d, heads.q_start * d + self.q_size)
        self.o_proj = RowParallelLinear(num_heads * d, c.hidden_size, spec.o_bias, dtype, q_cols)
        self.qk_norm = spec.qk_norm
        if spec.qk_norm == "head":
            self.q_norm, self.k_norm = _norm(spec, d, dtype), _norm(spec, d, dtype)
        elif spec.qk_norm == "all":
            self.q_norm = AllHeadsRMSNorm(num_heads * d, heads.q_start * d, self.q_size, spec.eps, dtype)
            self.k_norm = AllHeadsRMSNorm(num_kv_heads * d, heads.kv_start * d, self.kv_size, spec.eps, dtype)
        self.rope_style = spec.rope_style
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, attn_backend, scale=spec.attn_scale,
                              sliding_window=window, logits_soft_cap=spec.attn_soft_cap)
        self._ops = current_model_ops()

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor] | None, x: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        t, d = x.shape[0], self.head_size
        qkv = self.qkv_proj.forward(x)
        if self.qk_norm == "all":
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q, k, v = self.q_norm(q).view(t, -1, d), self.k_norm(k).view(t, -1, d), v.view(t, -1, d)
        else:
            q, k, v = qkv.view(t, -1, d).split_with_sizes(self._head_split, 1)
            if self.qk_norm == "head":
                q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            if self.rope_style == "neox":
                q, k = apply_rotary(self._ops, q, k, *rope)
            else:
                q, k = apply_rotary_interleaved(q, k, *rope)
        out = self.attn.forward(q, k, v, kv_cache, attn_metadata)
        return self.o_proj.forward(out.reshape(t, self.q_size))


class DenseDecoderLayer(nn.Module):
    """Attention then MLP, each between its optional input norm and output norm, on the residual stream
    (``residual_multiplier`` scales what each sublayer adds). Same calling convention as the Llama layer:
    ``(rope, x, residual, ...) -> (x, residual)``, the stream being ``residual + x``."""

    def __init__(self, c: Any, spec: DenseSpec, attn_backend: AttentionBackend, dtype: torch.dtype,
                 index: int) -> None:
        super().__init__()
        self.spec = spec
        self.rope_kind = spec.rope_kinds[index]
        self.self_attn = DenseAttention(c, spec, attn_backend, dtype, spec.windows[index])
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, dtype, spec.mlp_bias, activation=spec.activation)
        for name in spec.norms.values():
            setattr(self, name, _norm(spec, c.hidden_size, dtype))
        # role -> norm module, outside nn.Module's registry (the modules are registered under checkpoint names)
        self._roles: dict[str, nn.Module] = {role: getattr(self, name) for role, name in spec.norms.items()}
        self._ops = current_model_ops()
        self._native: Any = None

    def fast_path_record(self) -> DecoderLayerRecord | str:
        """The platform's fused form when the layer is Llama's shape, else why not (``fused_path_reason``)."""
        why = fused_path_reason(self.spec, self.rope_kind)
        if why:
            return why
        n1, n2, attn = self._roles["attn_in"], self._roles["mlp_in"], self.self_attn
        return DecoderLayerRecord(
            input_norm=NormRecord("rms", n1.weight, float(n1.eps)),
            post_attention_norm=NormRecord("rms", n2.weight, float(n2.eps)),
            qkv_proj=attn.qkv_proj, o_proj=attn.o_proj, gate_up_proj=self.mlp.gate_up_proj,
            down_proj=self.mlp.down_proj, attention=attn.attn, activation="silu", rope="neox", ops=self._ops)

    def native_layer(self) -> Any:
        if self._native is None:
            self._native = self._ops.decoder_layer(self.fast_path_record()) or False
        return self._native or None

    def _enter(self, role: str, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the sublayer's input, the stream) from the stream's parts: the add fused into an RMSNorm."""
        norm = self._roles.get(role)
        if residual is None:
            return (norm(x) if norm is not None else x), x
        if type(norm) is RMSNorm:
            return norm.add_forward(x, residual)
        stream = residual + x
        return (norm(stream) if norm is not None else stream), stream

    def _leave(self, role: str, h: torch.Tensor) -> torch.Tensor:
        norm = self._roles.get(role)
        h = norm(h) if norm is not None else h
        m = self.spec.residual_multiplier
        return h * m if m is not None and m != 1.0 else h

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor] | None, x: torch.Tensor,
                residual: torch.Tensor | None, kv_cache: torch.Tensor,
                attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        native = self.native_layer()
        if native:
            out = native(rope, x, residual, kv_cache, attn_metadata)
            if out is not None:
                return out
        h, residual = self._enter("attn_in", x, residual)
        h = self._leave("attn_out", self.self_attn.forward(rope, h, kv_cache, attn_metadata))
        h, residual = self._enter("mlp_in", h, residual)
        return self._leave("mlp_out", self.mlp.forward(h)), residual


class DenseModel(nn.Module):
    """Embedding (optionally scaled), the layers, the final norm; one rope lookup per table per step. With
    pipeline stages only this rank's part (``model_registry.layers.pipeline``), as ``LlamaModel``."""

    def __init__(self, c: Any, spec: DenseSpec, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        from model_registry.layers import VocabParallelEmbedding

        self.spec = spec
        self.stage = stage = StageLayers(spec.num_layers)
        self.embed_tokens = VocabParallelEmbedding(c.vocab_size, c.hidden_size, dtype) if stage.is_first else None
        used = {k for k in spec.rope_kinds if k is not None}
        self.rotary = nn.ModuleDict({
            kind: RotaryEmbedding(c, spec.head_size, spec.rotary_dim, spec.rope_bases[kind][1],
                                  spec.rope_bases[kind][0]) for kind in sorted(used)})
        self.layers = stage.build(spec.num_layers, lambda i: DenseDecoderLayer(c, spec, attn_backend, dtype, i))
        self.norm = _norm(spec, c.hidden_size, dtype) if stage.is_last else None
        self._ops = current_model_ops()
        self._native_stack: Any = None
        self.scale_inputs_embeds = True  # False: a multimodal shell passes embeddings it has scaled (Gemma 3)

    @property
    def rotary_emb(self) -> RotaryEmbedding:
        return next(iter(self.rotary.values()))

    def _stack(self) -> Callable[..., Any] | None:
        if self._native_stack is None:  # after loading; one rope table shared by every layer only
            one_table = len(self.rotary) == 1 and None not in self.spec.rope_kinds
            self._native_stack = (one_table and self._ops.decoder_stack(self.stage_layers)) or False
        return self._native_stack or None

    @property
    def stage_layers(self) -> list[nn.Module]:
        """This rank's layers, in order (all of them without pipeline stages)."""
        return list(self.layers)[self.stage.start:self.stage.end]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: list[AttentionMetadata], inputs_embeds: torch.Tensor | None = None,
                intermediate: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        s = self.spec
        residual: torch.Tensor | None
        if intermediate is None:
            x, residual = (self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds), None
            if s.embed_scale is not None and (inputs_embeds is None or self.scale_inputs_embeds):
                x = x * (torch.tensor(s.embed_scale, dtype=x.dtype) if s.embed_scale_in_dtype else s.embed_scale)
        else:
            x, residual = intermediate.hidden_states, intermediate.residual
        ropes = {kind: emb.lookup(positions, x.dtype) for kind, emb in self.rotary.items()}
        stack = self._stack() if residual is None else None  # the native stack starts from the embedding
        out = stack(ropes[s.rope_kinds[0]], x, kv_caches, attn_metadata) if stack else None
        if out is not None:
            x, residual = out
        else:
            for layer, kv_cache, md in zip(self.stage_layers, kv_caches, attn_metadata, strict=True):
                rope = ropes[layer.rope_kind] if layer.rope_kind is not None else None
                x, residual = layer.forward(rope, x, residual, kv_cache, md)
        if not self.stage.is_last:
            assert residual is not None  # every stage holds at least one layer
            return IntermediateTensors(x, residual)
        return self._final(x, residual)

    def _final(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        if residual is None:
            return self.norm(x)
        if type(self.norm) is RMSNorm:
            return self.norm.add_forward(x, residual)[0]
        return self.norm(residual + x)


class DenseForCausalLM(LlamaForCausalLM):
    """The causal LM over ``DenseModel``; a family subclass says only how its config maps to a ``DenseSpec``
    (``spec``). LoRA targets, tensor parallelism and loading are the Llama shell's; a checkpoint may hold q/k/v
    and gate/up stacked (``qkv_proj``, ``gate_up_proj``)."""

    family = "dense"

    @classmethod
    def spec(cls, hf_config: Any) -> DenseSpec:
        raise NotImplementedError

    def _build_model(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> nn.Module:
        self.dense_spec = self.spec(hf_config)
        return DenseModel(hf_config, self.dense_spec, attn_backend, dtype)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The LM head's logits, divided (Granite's ``logits_scaling``) or soft-capped (Gemma 2's
        ``cap * tanh(logits / cap)``) as the family does."""
        logits = self.lm_head(hidden_states)
        s = self.dense_spec
        if s.logits_divisor != 1.0:
            logits = logits / s.logits_divisor
        if s.final_soft_cap:
            logits = torch.tanh(logits / s.final_soft_cap) * s.final_soft_cap
        return logits

    @classmethod
    def fused_cpu_path(cls, hf_config: Any) -> str | None:
        """Why this family's layers do not take the CPU platform's fused decoder layer, or None when they do
        (read by the supported-architectures table, ``model_registry.support_table``)."""
        spec = cls.spec(hf_config)
        return next((why for kind in spec.rope_kinds if (why := fused_path_reason(spec, kind))), None)

    def ensure_positions(self, max_model_len: int) -> None:
        for emb in self.model.rotary.values():
            emb.ensure_positions(max_model_len)

    def lora_targets(self) -> dict[str, tuple[str, int, int]]:
        """The Llama shell's targets plus the stacked projections by their own names (Phi-3's adapters name
        ``qkv_proj`` and ``gate_up_proj``)."""
        out = super().lora_targets()
        attn, mlp = self.first_layer.self_attn, self.first_layer.mlp
        for i in range(self.num_layers):
            pre = f"model.layers.{i}."
            out[f"{pre}self_attn.qkv_proj"] = (f"{pre}self_attn.qkv_proj", 0, attn.q_size + 2 * attn.kv_size)
            out[f"{pre}mlp.gate_up_proj"] = (f"{pre}mlp.gate_up_proj", 0, 2 * mlp.intermediate_size)
        return out


def gemma_scale(c: Any, family: str) -> float:
    """Gemma's attention scale: ``query_pre_attn_scalar ** -0.5``."""
    return float(need(c, "query_pre_attn_scalar", family)) ** -0.5


def sqrt_hidden(c: Any) -> float:
    return math.sqrt(c.hidden_size)
