"""The shell every state-space and hybrid causal LM shares: embedding, a stack of layers, a final norm and the
LM head, with the engine's cache declaration, forward loop and checkpoint loading written once.

A layer may hold any number of caches (none: an MLP block; one: attention or a mixer; two: Falcon-H1's
mixer beside attention). The shell finds them in the layer's modules, in registration order: each
``Attention`` holds paged KV in the cache dtype, each ``MambaBase`` mixer a state in the model dtype. The
model's ``kv_caches`` and ``attn_metadata`` follow that order, and each layer gets its own slice.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from model_registry.layers.attention import Attention
from model_registry.layers.linear import QKVParallelLinear, RowParallelLinear
from model_registry.layers.mamba import MambaBase
from model_registry.layers.moe import FusedMoE, expert_weight
from model_registry.layers.norm import RMSNorm
from model_registry.layers.params import STACKED_PROJECTIONS, load_by_name
from model_registry.layers.pipeline import StageLayers
from model_registry.layers.rotary import RotaryEmbedding
from model_registry.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from vllite_core.attention.backend import AttentionBackend, AttentionMetadata
from vllite_core.core.kv_cache_spec import KVCacheSpec
from vllite_core.distributed.pipeline import IntermediateTensors
from vllite_core.model_interfaces import IsStateful
from vllite_core.model_ops import current_model_ops

CacheLayer = Attention | MambaBase
@dataclass(frozen=True)
class HybridStep:
    """What any layer of a step may read beside its input: the RoPE tables (None without rotary) and the
    scaled token embeddings (Zamba2's shared blocks read them again)."""

    rope: tuple[torch.Tensor, torch.Tensor] | None
    embeddings: torch.Tensor


def head_size(c: Any) -> int:
    """An attention head's width: ``head_dim``, else ``hidden_size / num_attention_heads``."""
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


class HybridAttention(nn.Module):
    """Self-attention with q, k and v in one matmul (``qkv_proj``: a platform's fused decoder path reads one
    weight; checkpoints' ``q_proj``/``k_proj``/``v_proj`` load into its shards, ``STACKED_PROJECTIONS``) and
    ``o_proj``, RoPE when the step has tables, through the ``Attention`` layer (``scale``: ``head_size ** -0.5``
    unless given). A variant changes q, k, v in ``project``."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_size: int,
                 backend: AttentionBackend, dtype: torch.dtype, bias: bool = False, scale: float | None = None,
                 out_size: int | None = None) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(hidden_size, head_size, num_heads, num_kv_heads, bias, dtype)
        heads = self.qkv_proj.heads
        self.num_heads, self.num_kv_heads, self.head_size = heads.num_heads, heads.num_kv_heads, head_size
        self.sizes = [self.num_heads * head_size, self.num_kv_heads * head_size, self.num_kv_heads * head_size]
        q_cols = (heads.q_start * head_size, heads.q_start * head_size + self.sizes[0])
        self.o_proj = RowParallelLinear(num_heads * head_size, out_size or hidden_size, bias, dtype, q_cols)
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_size, backend, scale)
        self.ops = current_model_ops()

    @classmethod
    def from_config(cls, c: Any, backend: AttentionBackend, dtype: torch.dtype, bias: bool = False,
                    scale: float | None = None) -> HybridAttention:
        """Heads and sizes under the usual config names."""
        return cls(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, head_size(c), backend, dtype, bias,
                   scale)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D], k and v [T, Hkv, D]."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).view(t, -1, self.head_size).split_with_sizes(
            [self.num_heads, self.num_kv_heads, self.num_kv_heads], 1)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               md: AttentionMetadata, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        if rope is not None:
            q, k = self.ops.rotary(q, k, *rope)
        return self.o_proj(self.attn(q, k, v, kv_cache, md).reshape(q.shape[0], -1))

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata,
                rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        return self.attend(*self.project(x), kv_cache, md, rope)


def cache_layers(layer: nn.Module) -> list[CacheLayer]:
    """The modules of ``layer`` that hold a cache, in the order of its ``kv_caches``."""
    return [m for m in layer.modules() if isinstance(m, (Attention, MambaBase))]


class HybridForCausalLM(nn.Module, IsStateful):
    """``model.embed_tokens``, ``model.layers`` (each called ``layer(x, caches, metadata, step)``),
    ``model.norm`` and ``lm_head`` (tied to the embedding unless the config says otherwise; ``tie_default`` when
    it is silent). ``renames``: checkpoint name parts -> the shell's (``backbone.norm_f.`` -> ``model.norm.``).
    A subclass builds its layers and may set ``rotary_emb`` and ``embedding_multiplier``."""

    tie_default: ClassVar[bool] = False
    renames: tuple[tuple[str, str], ...] = ()  # (old, new) substrings, replaced in order

    def __init__(self, hf_config: Any, dtype: torch.dtype, layers: Iterable[nn.Module] | Callable[[int], nn.Module],
                 norm_eps: float) -> None:
        """``layers``: every layer, or ``make(i)`` building layer ``i`` (a class with pipeline stages: only this
        rank's stage's layers are built, model_registry.layers.pipeline)."""
        super().__init__()
        c = hf_config
        self.config = c
        self.dtype = dtype
        self.vocab_size: int = c.vocab_size
        self.hidden_size: int = c.hidden_size
        self.stage = stage = StageLayers(int(c.num_hidden_layers))
        self.model = nn.Module()
        self.model.embed_tokens = VocabParallelEmbedding(c.vocab_size, c.hidden_size, dtype) if stage.is_first \
            else None
        self.model.layers = stage.build(int(c.num_hidden_layers), layers) if callable(layers) \
            else nn.ModuleList(layers)
        self.model.norm = RMSNorm(c.hidden_size, norm_eps, dtype) if stage.is_last else None
        self.tie_word_embeddings = bool(getattr(c, "tie_word_embeddings", self.tie_default))
        tied = self.model.embed_tokens if self.tie_word_embeddings and stage.is_first else None
        self.lm_head = ParallelLMHead(c.vocab_size, c.hidden_size, dtype, tied=tied) if stage.is_last else None
        self.rotary_emb: RotaryEmbedding | None = None
        self.embedding_multiplier: float | None = None
        self._caches = [len(cache_layers(layer)) for layer in self.model.layers]

    # A layer adds its own residual: a pipeline stage hands the next only the stream (pp_runner.py). Subclasses
    # whose layers are built per stage (``make(i)``) declare ``supports_pipeline_parallel``.
    pipeline_residual = False

    def get_kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec]:
        """Attention: paged KV in the cache dtype; mixers: one state row in the model dtype."""
        return [m.kv_cache_spec(block_size, dtype if isinstance(m, Attention) else self.dtype)
                for layer in self.model.layers for m in cache_layers(layer)]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        return x if self.embedding_multiplier is None else x * self.embedding_multiplier

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: list[Any], intermediate: IntermediateTensors | None = None
                ) -> torch.Tensor | IntermediateTensors:
        """Final hidden states, or on a pipeline stage before the last the stream the next stage continues from
        (in the model dtype); ``kv_caches`` are this stage's layers'."""
        x = self.embed_input_ids(input_ids) if intermediate is None else intermediate.hidden_states
        rope = self.rotary_emb.lookup(positions, x.dtype) if self.rotary_emb is not None else None
        step = HybridStep(rope, x)
        i = 0
        # This stage's layers (every layer of a whole model, whatever its config counts).
        start, end = (0, len(self._caches)) if self.stage.is_whole else (self.stage.start, self.stage.end)
        for layer, n in zip(self.model.layers[start:end], self._caches[start:end], strict=True):
            x = layer(x, kv_caches[i:i + n], attn_metadata[i:i + n], step)
            i += n
        if not self.stage.is_last:
            return IntermediateTensors(x.to(self.dtype), None)
        return self.model.norm(x.to(self.dtype))  # Mamba's residual stream may be float32

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states).float()

    def ensure_positions(self, max_model_len: int) -> None:
        if self.rotary_emb is not None:
            self.rotary_emb.ensure_positions(max_model_len)

    def rename(self, name: str) -> str | None:
        """A checkpoint name -> this model's parameter name (None: skip it, as a tied head's copy)."""
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return None
        for old, new in self.renames:
            name = name.replace(old, new)
        return self.stage.weight_name(name, self.tie_word_embeddings)

    def skips_weight(self, hf_name: str) -> bool:
        """Another pipeline stage's tensor: the loader does not read it."""
        return not self.stage.is_whole and self.rename(hf_name) is None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load by (renamed) name, separate projections into their fused one's shards (``STACKED_PROJECTIONS``),
        per-expert tensors into their ``FusedMoE``; a parameter reachable under several names (a tied head,
        Zamba2's shared blocks) counts as loaded under all of them."""
        moes = {name: m for name, m in self.named_modules() if isinstance(m, FusedMoE)}
        pieces = dict.fromkeys(moes, 0)

        def by_name() -> Iterator[tuple[str, torch.Tensor]]:
            for hf_name, tensor in weights:
                name = self.rename(hf_name)
                expert = expert_weight(name) if name is not None else None
                if expert is not None and expert[0] in moes:
                    moes[expert[0]].load_expert(tensor, expert[1], expert[2], hf_name)
                    pieces[expert[0]] += 1
                else:
                    yield hf_name, tensor

        loaded = load_by_name(self, by_name(), self.rename, STACKED_PROJECTIONS)
        for name, moe in moes.items():
            if pieces[name] == 3 * moe.num_experts:  # every expert's gate, up and down
                loaded.update((f"{name}.w13_weight", f"{name}.w2_weight"))
        names: dict[int, list[str]] = {}
        for name, p in self.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        for aliases in names.values():
            if loaded.intersection(aliases):
                loaded.update(aliases)
        return loaded
