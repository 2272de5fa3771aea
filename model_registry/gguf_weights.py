"""GGUF tensors as Hugging Face-named float tensors.

Each tensor is dequantised with ``gguf.quants.dequantize`` (any type it knows:
Q4_0/Q4_1/Q5_x/Q8_0/K-quants/F16/BF16/F32...) and renamed from llama.cpp's
scheme to transformers'. llama.cpp's converter permutes the rows of q and k
weights of "llama" models so its rotary kernel can rotate adjacent pairs; the
permutation is undone here so the weights match the HF checkpoint layout.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Container, Iterator

import numpy as np
import torch

from model_registry.gguf_file import GGUFFile
from model_registry.layers.params import deferred
from vllite_core.errors import ConfigError

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",  # qwen3, gemma3: per-head q/k norms
    "attn_k_norm": "self_attn.k_norm",
}
_GEMMA_NAMES = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# Where an architecture's names differ from the llama scheme: Gemma's four norms; Phi-3's stacked q/k/v and
# gate/up (llama.cpp keeps Phi-3's gate_up_proj, gate rows first, as ffn_up).
# Mixtures of experts: the router and the experts' tensors, stacked [experts, rows, columns] in the file, whose HF
# names hold "{}" for the expert's index (iter_gguf_weights yields one tensor per expert).
_MIXTRAL_NAMES = {"ffn_gate_inp": "block_sparse_moe.gate", "ffn_gate_exps": "block_sparse_moe.experts.{}.w1",
                  "ffn_up_exps": "block_sparse_moe.experts.{}.w3", "ffn_down_exps": "block_sparse_moe.experts.{}.w2"}
_QWEN_MOE_NAMES = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.{}.gate_proj",
                   "ffn_up_exps": "mlp.experts.{}.up_proj", "ffn_down_exps": "mlp.experts.{}.down_proj"}
# Qwen2-MoE's shared expert and its sigmoid gate.
_QWEN2_MOE_NAMES = {**_QWEN_MOE_NAMES, "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
                    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
                    "ffn_down_shexp": "mlp.shared_expert.down_proj"}
_ARCH_BLOCK_NAMES = {"gemma2": _GEMMA_NAMES, "gemma3": _GEMMA_NAMES,
                     "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
                     "mixtral": _MIXTRAL_NAMES, "qwen2moe": _QWEN2_MOE_NAMES, "qwen3moe": _QWEN_MOE_NAMES}
# llama.cpp's Gemma converters store every RMSNorm weight as 1 + w (its norm multiplies by the weight alone);
# transformers' Gemma norms multiply by 1 + w: the 1 is taken off again here.
_NORM_PLUS_ONE = {"gemma", "gemma2", "gemma3"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Tensors llama.cpp adds that have no HF counterpart (precomputed rope factors; Phi-3's LongRoPE factors, which
# gguf_config reads into the config).
_SKIPPED = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
# llama.cpp architectures whose converter permutes q/k for its rotary layout.
_PERMUTED_ARCHS = {"llama"}


def family(gguf: GGUFFile) -> str:
    """The naming scheme of a file's tensors: its architecture, or "mixtral" for llama.cpp's Llama with experts."""
    experts = gguf.metadata.get(f"{gguf.architecture}.expert_count", 0)
    return "mixtral" if gguf.architecture == "llama" and int(experts or 0) > 0 else gguf.architecture


def hf_name(gguf_name: str, architecture: str = "llama") -> str | None:
    """The transformers parameter name for a llama.cpp tensor name (None: no counterpart; "{}" in it: a stack of
    experts, one name per index) under ``architecture`` (``family``); ConfigError for a tensor the mapping does
    not know (loading it as something else would give wrong answers)."""
    if gguf_name in _SKIPPED:
        return None
    base, _, kind = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    m = _BLOCK_RE.match(gguf_name)
    names = {**_BLOCK_NAMES, **_ARCH_BLOCK_NAMES.get(architecture, {})}
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    raise ConfigError(f"GGUF tensor {gguf_name!r} ({architecture}) has no known Hugging Face name")


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's ``reshape(n_head, 2, d, ...).swapaxes(1, 2)`` on the rows of a q/k weight or bias."""
    d = w.shape[0] // n_head // 2
    return w.reshape(n_head, d, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_gguf_weights(gguf: GGUFFile, num_heads: int, num_kv_heads: int, dtype: torch.dtype = torch.float32,
                      defer: Callable[[str, str], bool] | None = None,
                      only: Container[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor of the file (of ``only``'s HF names, when given), dequantised to float32
    and cast to ``dtype``; a tensor ``defer(HF name, ggml type name)`` picks is a ``params.deferred`` stand-in of its
    shape instead (nothing dequantised)."""
    permute = gguf.architecture in _PERMUTED_ARCHS
    plus_one = gguf.architecture in _NORM_PLUS_ONE
    names = family(gguf)
    for name in gguf.tensors:
        target = hf_name(name, names)
        if target is None or (only is not None and target not in only):
            continue
        info = gguf.tensors[name]
        if defer is not None and defer(target, info.ggml_type.name):
            if "{}" in target:
                for e in range(info.shape[0]):
                    yield target.format(e), deferred(info.shape[1:])
            else:
                yield target, deferred(info.shape)
            continue
        data = gguf.dequantize(name)
        if plus_one and name.endswith("norm.weight"):
            data = data - np.float32(1.0)
        if permute and ".attn_q." in name:
            data = unpermute_rotary(data, num_heads)
        elif permute and ".attn_k." in name:
            data = unpermute_rotary(data, num_kv_heads)
        tensor = torch.from_numpy(np.ascontiguousarray(data))
        tensor = tensor if tensor.dtype == dtype else tensor.to(dtype)
        if "{}" in target:  # [experts, rows, columns]: each expert's matrix under its own name
            for e in range(tensor.shape[0]):
                yield target.format(e), tensor[e]
        else:
            yield target, tensor
