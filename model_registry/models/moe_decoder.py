"""The decoder shared by the mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GraniteMoE):
pre-norm layers of RoPE attention and a feed-forward that is a ``FusedMoE`` or, on some layers, a dense
``GatedMLP``. A family is a ``MoeFamily`` record read from its config (``family`` in each model file); the
layers come from ``model_registry.layers``.

Attention variants covered: q/k/v bias without an o bias (Qwen2-MoE), a per-head q/k RMSNorm (Qwen3-MoE),
an RMSNorm over the whole q and k projections and q/k/v clipping (OLMoE), a fixed attention scale and
scalar multipliers on the embeddings, the residual branches and the logits (Granite).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from model_registry.layers import (
    Attention,
    FusedMoE,
    GatedMLP,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    ShardedRMSNorm,
    ShardsByHeads,
    TopKRouter,
    VocabParallelEmbedding,
)
from model_registry.layers.moe import expert_weight
from model_registry.layers.params import STACKED_PROJECTIONS, load_by_name
from model_registry.layers.pipeline import StageLayers
from vllite_core.attention.backend import AttentionBackend, AttentionMetadata
from vllite_core.core.kv_cache_spec import KVCacheSpec
from vllite_core.distributed import get_tp
from vllite_core.distributed.pipeline import IntermediateTensors
from vllite_core.distributed.sharding import shard_experts
from vllite_core.errors import ConfigError
from vllite_core.model_interfaces import SupportsExpertParallel
from vllite_core.model_ops import current_model_ops

QKNorm = Literal["head", "full"] | None  # per head (Qwen3), over the whole projection (OLMoE), none


@dataclass(frozen=True)
class MoeFamily:
    """What one family's checkpoints differ in. ``moe_layers[i]``: layer i has experts (else a dense MLP of
    ``intermediate_size``); ``renames``: checkpoint name parts -> this shell's (``.block_sparse_moe.`` ->
    ``.mlp.``), applied in order."""

    num_experts: int
    top_k: int
    moe_intermediate_size: int
    moe_layers: tuple[bool, ...]
    renormalize: bool
    renames: tuple[tuple[str, str], ...]
    intermediate_size: int | None = None
    shared_intermediate_size: int | None = None
    shared_expert_gate: bool = False
    qkv_bias: bool = False
    qk_norm: QKNorm = None
    clip_qkv: float | None = None
    attention_scale: float | None = None
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # Router options (``TopKRouter``): DeepSeek's sigmoid scores, grouped top-k, correction bias, scaling.
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    n_group: int | None = None
    topk_group: int | None = None
    correction_bias: bool = False
    routed_scaling_factor: float = 1.0


def check_experts(num_experts: int, top_k: int) -> None:
    """A router that cannot pick ``top_k`` distinct experts is a ConfigError at load."""
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise ConfigError(f"num_experts_per_tok ({top_k}) must be between 1 and the number of experts "
                          f"({num_experts})")


def head_size_of(c: Any) -> int:
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


class MoeAttention(nn.Module):
    """RoPE self-attention with q/k/v fused (``qkv_proj``), the family's q/k norm and clipping."""

    def __init__(self, c: Any, fam: MoeFamily, backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        d = self.head_size = head_size_of(c)
        heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
        eps = float(c.rms_norm_eps)
        self.qkv_proj = QKVParallelLinear(c.hidden_size, d, heads, kv_heads, fam.qkv_bias, dtype)
        h = self.qkv_proj.heads
        self.num_heads, self.num_kv_heads = h.num_heads, h.num_kv_heads
        self.sizes = [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d]
        self.o_proj = RowParallelLinear(heads * d, c.hidden_size, False, dtype,
                                        (h.q_start * d, h.q_start * d + self.sizes[0]))
        self.qk_norm = fam.qk_norm
        if fam.qk_norm == "head":
            self.q_norm, self.k_norm = RMSNorm(d, eps, dtype), RMSNorm(d, eps, dtype)
        elif fam.qk_norm == "full" and h.num_heads == heads:
            self.q_norm, self.k_norm = RMSNorm(heads * d, eps, dtype), RMSNorm(kv_heads * d, eps, dtype)
        elif fam.qk_norm == "full":  # heads split over ranks: the norm's sums span them (one all-reduce each)
            replicas = max(1, get_tp().world_size // kv_heads)
            self.q_norm = ShardedRMSNorm(heads * d, (h.q_start * d, (h.q_start + h.num_heads) * d), eps, dtype)
            self.k_norm = ShardedRMSNorm(kv_heads * d, (h.kv_start * d, (h.kv_start + h.num_kv_heads) * d), eps,
                                         dtype, replicas)
        self.clip_qkv = fam.clip_qkv
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, backend, fam.attention_scale)
        self.ops = current_model_ops()

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        return self.attn.kv_cache_spec(block_size, dtype)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
                md: AttentionMetadata) -> torch.Tensor:
        t, d = x.shape[0], self.head_size
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (y.clamp(-self.clip_qkv, self.clip_qkv) for y in (q, k, v))
        q, k, v = q.reshape(t, -1, d), k.reshape(t, -1, d), v.reshape(t, -1, d)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.ops.rotary(q, k, *rope)
        return self.o_proj(self.attn(q, k, v, kv_cache, md).reshape(t, -1))


class MoeDecoderLayer(nn.Module):
    """Pre-norm attention then feed-forward (``mlp``: a ``FusedMoE``, a dense ``GatedMLP``, or a family's own),
    each branch scaled by the residual multiplier."""

    def __init__(self, c: Any, fam: MoeFamily, attention: nn.Module, mlp: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        eps = float(c.rms_norm_eps)
        self.input_layernorm = RMSNorm(c.hidden_size, eps, dtype)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(c.hidden_size, eps, dtype)
        self.mlp = mlp
        self.residual_multiplier = fam.residual_multiplier

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
                md: AttentionMetadata) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), rope, kv_cache, md)
        x = x + h * self.residual_multiplier if self.residual_multiplier != 1.0 else x + h
        h = self.mlp(self.post_attention_layernorm(x))
        return x + h * self.residual_multiplier if self.residual_multiplier != 1.0 else x + h


def load_with_experts(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], rename: Any) -> set[str]:
    """Load by (renamed) name, separate projections into their fused shards, per-expert tensors into their
    ``FusedMoE``; a ``FusedMoE`` missing one expert's tensor is an error naming it."""
    moes = {name: m for name, m in model.named_modules() if isinstance(m, FusedMoE)}
    arrived: dict[str, set[tuple[int, str]]] = {name: set() for name in moes}

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for hf_name, tensor in weights:
            name = rename(hf_name)
            expert = expert_weight(name) if name is not None else None
            if expert is not None and expert[0] in moes:
                moe = moes[expert[0]]
                if expert[1] >= moe.num_experts:
                    raise ValueError(f"weight {hf_name}: expert {expert[1]} is past the config's "
                                     f"{moe.num_experts} experts")
                moe.load_expert(tensor, expert[1], expert[2], hf_name)
                arrived[expert[0]].add((expert[1], expert[2]))
            else:
                yield hf_name, tensor

    loaded = load_by_name(model, tensors(), rename, STACKED_PROJECTIONS)
    for name, moe in moes.items():
        if f"{name}.w13_weight" in loaded and f"{name}.w2_weight" in loaded:
            continue  # stacked in the checkpoint
        missing = [f"{e}.{s}" for e in range(moe.num_experts) for s in ("w1", "w2", "w3")
                   if (e, s) not in arrived[name]]
        if arrived[name] and missing:
            raise ValueError(f"{name}: the checkpoint lacks expert weight(s) {', '.join(missing[:8])}")
        if arrived[name]:
            loaded.update((f"{name}.w13_weight", f"{name}.w2_weight"))
    return loaded


class MoeForCausalLM(nn.Module, ShardsByHeads, SupportsExpertParallel):
    """Embedding, ``MoeDecoderLayer``s, final norm and LM head; a family's file supplies ``family(config)``.
    Over tensor-parallel ranks the attention heads split as Llama's do and every expert's intermediate
    dimension splits (``FusedMoE``), or with expert parallelism the experts are placed whole by rank; a family
    whose layers cannot split refuses in ``check_tensor_parallel``. ``quantization="gguf"``: a GGUF file's
    projections and experts computed from their blocks."""

    supported_quantization = ("gguf",)

    @classmethod
    def check_expert_parallel(cls, hf_config: Any, tensor_parallel_size: int) -> None:
        """SupportsExpertParallel: ConfigError when the routed experts do not divide over the ranks."""
        shard_experts(cls.family(hf_config).num_experts, tensor_parallel_size, 0)

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        c = self.config = hf_config
        fam = self.fam = self.family(c)
        check_experts(fam.num_experts, fam.top_k)
        self.dtype = dtype
        self.vocab_size: int = c.vocab_size
        self.hidden_size: int = c.hidden_size
        # With pipeline stages only this rank's layers are built (model_registry.layers.pipeline): the embedding
        # on the first stage, the final norm and the head on the last.
        num_layers = len(fam.moe_layers)
        self.stage = stage = StageLayers(num_layers)
        self.model = nn.Module()
        self.model.embed_tokens = VocabParallelEmbedding(c.vocab_size, c.hidden_size, dtype) if stage.is_first \
            else None
        self.model.layers = stage.build(num_layers, lambda i: MoeDecoderLayer(
            c, fam, self.make_attention(c, fam, i, attn_backend, dtype),
            self.make_mlp(c, fam, fam.moe_layers[i], dtype), dtype))
        self.model.norm = RMSNorm(c.hidden_size, float(c.rms_norm_eps), dtype) if stage.is_last else None
        self.model.rotary_emb = RotaryEmbedding(c, self.rotary_dim(c))
        self.tie_word_embeddings = bool(getattr(c, "tie_word_embeddings", False))
        # Tied to the embedding when this stage holds it, else (a last stage after the first) its own copy.
        tied = self.model.embed_tokens if self.tie_word_embeddings and stage.is_first else None
        self.lm_head = ParallelLMHead(c.vocab_size, c.hidden_size, dtype, tied=tied) if stage.is_last else None

    # Pipeline stages (``pipeline_parallel_size``): each rank builds its stage's layers; a layer adds its own
    # residual, so a stage hands the next only the hidden states (vllite_core.worker.pp_runner).
    supports_pipeline_parallel = True
    pipeline_residual = False

    @property
    def stage_layers(self) -> list[nn.Module]:
        """This rank's layers, in order (all of them without pipeline stages)."""
        return list(self.model.layers)[self.stage.start:self.stage.end]

    @classmethod
    def family(cls, c: Any) -> MoeFamily:
        raise NotImplementedError

    def make_attention(self, c: Any, fam: MoeFamily, layer: int, backend: AttentionBackend,
                       dtype: torch.dtype) -> nn.Module:
        """Layer ``layer``'s attention: called ``(x, rope, kv_cache, metadata)``, declares ``kv_cache_spec``."""
        return MoeAttention(c, fam, backend, dtype)

    def make_mlp(self, c: Any, fam: MoeFamily, sparse: bool, dtype: torch.dtype) -> nn.Module:
        """A layer's feed-forward: the routed experts (and shared ones) when ``sparse``, else a dense MLP."""
        if sparse:
            router = TopKRouter(c.hidden_size, fam.num_experts, fam.top_k, dtype, fam.scoring, fam.renormalize,
                                fam.n_group, fam.topk_group, fam.correction_bias, fam.routed_scaling_factor)
            return FusedMoE(router, c.hidden_size, fam.moe_intermediate_size, dtype, fam.shared_intermediate_size,
                            fam.shared_expert_gate)
        assert fam.intermediate_size is not None, "a dense layer needs intermediate_size"
        return GatedMLP(c.hidden_size, fam.intermediate_size, dtype)

    @classmethod
    def rotary_dim(cls, c: Any) -> int:
        return head_size_of(c)

    def get_kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec]:
        return [layer.self_attn.kv_cache_spec(block_size, dtype) for layer in self.stage_layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: list[AttentionMetadata], intermediate: IntermediateTensors | None = None
                ) -> torch.Tensor | IntermediateTensors:
        """Final hidden states, or on a stage before the last the stream the next stage continues from;
        ``intermediate``: what the previous stage handed this one."""
        if intermediate is None:
            x = self.model.embed_tokens(input_ids)
            if self.fam.embedding_multiplier != 1.0:
                x = x * self.fam.embedding_multiplier
        else:
            x = intermediate.hidden_states
        rope = self.model.rotary_emb.lookup(positions, x.dtype)
        for layer, cache, md in zip(self.stage_layers, kv_caches, attn_metadata, strict=True):
            x = layer(x, rope, cache, md)
        if not self.stage.is_last:
            return IntermediateTensors(x, None)
        return self.model.norm(x)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden_states)
        return logits if self.fam.logits_scaling == 1.0 else logits / self.fam.logits_scaling

    def ensure_positions(self, max_model_len: int) -> None:
        self.model.rotary_emb.ensure_positions(max_model_len)

    def rename(self, name: str) -> str | None:
        if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.tie_word_embeddings):
            return None
        for old, new in self.fam.renames:
            name = name.replace(old, new)
        return self.stage.weight_name(name, self.tie_word_embeddings)

    def skips_weight(self, hf_name: str) -> bool:
        """Another stage's tensor (and a tied head's copy): the loader does not read it."""
        return self.rename(hf_name) is None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = load_with_experts(self, weights, self.rename)
        if self.tie_word_embeddings and self.stage.is_first and "model.embed_tokens.weight" in loaded:
            loaded.add("lm_head.weight")
        return loaded
