"""vllite's model layers: the one place model code, built-in or plugin, takes its building blocks from.

Public and versioned (``LAYERS_API``: a minor bump adds, a major bump changes or removes); docs/models.md
has a worked example. Every layer's weights are uninitialised parameters filled by the checkpoint
(``load_parameter`` calls a parameter's ``weight_loader``, which slices this rank's part).

- ``linear``: ``ReplicatedLinear``, ``ColumnParallelLinear``, ``MergedColumnParallelLinear``,
  ``QKVParallelLinear``, ``RowParallelLinear``, each with a quantization method and a LoRA slot;
- ``vocab``: ``VocabParallelEmbedding``, ``ParallelLMHead`` (tied or not);
- ``embedding``: ``Embedding``, a replicated table (learned positions, token types);
- ``conv``: ``Conv1d``, ``Conv2d`` (an encoder's audio frames and image patches);
- ``norm``: ``RMSNorm``, ``ShardedRMSNorm`` (over a dimension split over ranks), ``GemmaRMSNorm`` (the
  ``(1 + w)`` form), ``LayerNorm``, ``rms_normalize``;
- ``rotary``: ``RotaryEmbedding`` (default, linear, dynamic, llama3, yarn, longrope; partial rotary, a base of its
  own, per-layer-type parameters), ``MRotaryEmbedding``, ``apply_rotary_interleaved`` (GLM-4's pairs),
  ``rotary_dim_of``;
- ``activation``: ``get_act_fn``, ``gated``;
- ``attention``: ``Attention``, which declares its KV cache spec;
- ``mlp``: ``GatedMLP``, the SiLU-gated feed-forward (gate/up fused, tensor-parallel);
- ``moe``: ``TopKRouter`` (softmax/sigmoid, renormalised, grouped, correction bias), ``FusedMoE`` (experts through
  one platform op, ``ModelOps.fused_moe``; shared experts as a ``GatedMLP``; tensor-parallel over the experts'
  intermediate dimension);
- ``mla``: ``MLAAttention``, DeepSeek's multi-head latent attention over its own latent cache (``MLAAttentionSpec``);
- ``sink_attention``: ``SinkAttention``, attention with a learned sink logit per head (gpt-oss), its own cache;
- ``mamba``: the state-space mixers (``MambaMixer``, ``Mamba2Mixer``, ``ShortConv``), each declaring its state;
- ``hybrid``: ``HybridForCausalLM``, the shell the state-space and hybrid models share, ``HybridAttention``;
- ``fast_path``: the typed record a platform's fused decoder path reads;
- ``quantization``: the linear layers' methods (``int8``, ``gguf``);
- ``ops``: ``TORCH_OPS``, plain torch ops a model pins where it keeps torch's numerics;
- ``tensor_parallel``: ``ShardsByHeads``, the tensor-parallel declaration of a model that splits by its heads;
  ``ShardsHybrid`` / ``ShardsMamba2Hybrid``, the same for a hybrid whose other mixers split their own way.
"""
from __future__ import annotations

from model_registry.layers.activation import gated, get_act_fn
from model_registry.layers.attention import Attention
from model_registry.layers.conv import Conv1d, Conv2d
from model_registry.layers.embedding import Embedding
from model_registry.layers.fast_path import DecoderLayerRecord, NormRecord
from model_registry.layers.hybrid import HybridAttention, HybridForCausalLM, HybridStep
from model_registry.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    Segment,
)
from model_registry.layers.mamba import Mamba2Dims, Mamba2Mixer, MambaBase, MambaMixer, ShortConv
from model_registry.layers.mla import MLAAttention
from model_registry.layers.mlp import GatedMLP
from model_registry.layers.moe import FusedMoE, TopKRouter
from model_registry.layers.norm import GemmaRMSNorm, LayerNorm, RMSNorm, ShardedRMSNorm, rms_normalize
from model_registry.layers.ops import TORCH_OPS
from model_registry.layers.params import copy_checked, empty_param, load_parameter
from model_registry.layers.rotary import (
    MRotaryEmbedding,
    RotaryEmbedding,
    apply_rotary,
    apply_rotary_interleaved,
    rope_parameters,
    rotary_dim_of,
)
from model_registry.layers.sink_attention import SinkAttention
from model_registry.layers.tensor_parallel import ShardsByHeads, ShardsHybrid, ShardsMamba2Hybrid
from model_registry.layers.vocab import ParallelLMHead, VocabParallelEmbedding

# (major, minor) of this package's public names; 1.1: MLAAttention, SinkAttention; 1.2: apply_rotary_interleaved,
# rotary_dim_of; 1.3: ShardedRMSNorm; 1.4: ShardsByHeads; 1.5: ShardsHybrid, ShardsMamba2Hybrid
LAYERS_API = (1, 5)

__all__ = [
    "LAYERS_API", "TORCH_OPS", "Attention", "ColumnParallelLinear", "Conv1d", "Conv2d", "DecoderLayerRecord",
    "Embedding", "FusedMoE", "GatedMLP", "GemmaRMSNorm", "HybridAttention", "HybridForCausalLM", "HybridStep",
    "LayerNorm", "LinearBase", "MLAAttention", "MRotaryEmbedding", "Mamba2Dims", "Mamba2Mixer", "MambaBase",
    "MambaMixer", "MergedColumnParallelLinear", "NormRecord", "ParallelLMHead", "QKVParallelLinear", "RMSNorm",
    "ReplicatedLinear", "RotaryEmbedding", "RowParallelLinear", "Segment", "ShardedRMSNorm", "ShardsByHeads",
    "ShardsHybrid", "ShardsMamba2Hybrid",
    "ShortConv", "SinkAttention", "TopKRouter",
    "VocabParallelEmbedding", "apply_rotary", "apply_rotary_interleaved", "copy_checked", "empty_param", "gated",
    "get_act_fn", "load_parameter", "rms_normalize", "rope_parameters", "rotary_dim_of",
]
