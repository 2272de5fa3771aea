"""A transformers config built from GGUF metadata.

``AutoConfig.from_pretrained(folder, gguf_file=...)`` parses the whole file with
``gguf.GGUFReader`` (seconds) and leaves ``architectures`` unset; reading the few
keys we need from ``GGUFFile`` is instant and lets us fill in the architecture,
the special-token ids and the tied-embedding flag ourselves.
"""
from __future__ import annotations

import logging
from typing import Any

from model_registry.gguf_file import GGUFFile
from vllite_core.errors import ConfigError

logger = logging.getLogger("vllite.model_registry")

# llama.cpp architecture -> (transformers model_type, architecture name).
GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}
# llama.cpp files Mixtral as a "llama" with an expert count.
GGUF_EXPERT_ARCHITECTURES: dict[str, tuple[str, str]] = {"llama": ("mixtral", "MixtralForCausalLM")}
# llama.cpp scales Gemma's attention by 1/sqrt(hidden / heads) for the 27B models (46 layers for Gemma 2, 62 for
# Gemma 3) and by 1/sqrt(head_dim) otherwise: the query_pre_attn_scalar the checkpoints had.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


class UnsupportedGGUFError(ValueError):
    """The GGUF file holds an architecture vllite cannot load from GGUF."""


def gguf_model_type(gguf: GGUFFile) -> tuple[str, str]:
    """(model_type, architecture) for a GGUF file; llama.cpp files Mistral models, and Mixtral's (with an expert
    count), under "llama"."""
    arch = gguf.architecture
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedGGUFError(
            f"{gguf.path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}")
    if int(gguf.metadata.get(f"{arch}.expert_count", 0) or 0) > 0 and arch in GGUF_EXPERT_ARCHITECTURES:
        return GGUF_EXPERT_ARCHITECTURES[arch]
    name = str(gguf.metadata.get("general.name", "")).lower()
    if arch == "llama" and "mistral" in name:
        return GGUF_ARCHITECTURES["mistral"]
    return GGUF_ARCHITECTURES[arch]


def config_from_gguf(gguf: GGUFFile) -> Any:
    """A ``PretrainedConfig`` for the model in ``gguf`` (``GGUF_ARCHITECTURES``' families, Mixtral)."""
    from transformers import AutoConfig

    arch = gguf.architecture
    model_type, architecture = gguf_model_type(gguf)
    md = gguf.metadata

    def get(key: str, default: Any = None) -> Any:
        value = md.get(f"{arch}.{key}", default)
        return value.item() if hasattr(value, "item") else value

    def need(key: str) -> Any:
        value = get(key)
        if value is None:
            raise ConfigError(f"{gguf.path}: GGUF metadata lacks {arch}.{key}, which {architecture} needs")
        return value

    n_heads = int(need("attention.head_count"))
    n_kv = get("attention.head_count_kv", n_heads)
    if hasattr(n_kv, "__len__"):  # per-layer list in some files
        n_kv = max(int(x) for x in n_kv)
    hidden = int(need("embedding_length"))
    tokens = md.get("tokenizer.ggml.tokens")
    vocab_size = get("vocab_size") or (len(tokens) if tokens is not None else None)
    if vocab_size is None:
        vocab_size = gguf.tensors["token_embd.weight"].shape[0]
    kwargs: dict[str, Any] = dict(
        architectures=[architecture],
        vocab_size=int(vocab_size),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_hidden_layers=int(need("block_count")),
        num_attention_heads=n_heads,
        num_key_value_heads=int(n_kv),
        max_position_embeddings=int(get("context_length", 2048)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_parameters=_rope_parameters(get),
        tie_word_embeddings="output.weight" not in gguf.tensors,
    )
    rope_dim = get("rope.dimension_count")
    head_dim = get("attention.key_length") or (rope_dim if model_type not in ("qwen2", "phi3") else None)
    if head_dim:
        kwargs["head_dim"] = int(head_dim)
    kwargs.update(_family_fields(gguf, arch, get, need, kwargs))
    for key, attr in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("padding_token_id", "pad_token_id")):
        value = md.get(f"tokenizer.ggml.{key}")
        if value is not None:
            kwargs[attr] = int(value)
    window = get("attention.sliding_window")
    if window:
        kwargs["sliding_window"] = int(window)
        if model_type == "qwen2":
            kwargs["use_sliding_window"] = True
    if "rope_freqs.weight" in gguf.tensors:
        logger.warning("%s: the rope_freqs tensor (llama3-style rope factors) is ignored, as transformers does",
                       gguf.path)
    if md.get("general.name"):
        kwargs["_name_or_path"] = str(md["general.name"])
    return AutoConfig.for_model(model_type, **kwargs)


def _family_fields(gguf: GGUFFile, arch: str, get: Any, need: Any, kw: dict[str, Any]) -> dict[str, Any]:
    """What the Gemma, Phi-3 and mixture-of-experts configs take beyond the Llama fields, from llama.cpp's keys."""
    out: dict[str, Any] = {}
    experts = get("expert_count")
    if experts:  # Mixtral ("llama" with experts), Qwen2/3-MoE (llama.cpp renormalises Qwen3-MoE's top-k weights)
        out["num_experts_per_tok"] = int(need("expert_used_count"))
        if arch in ("qwen2moe", "qwen3moe"):
            out.update(num_experts=int(experts), moe_intermediate_size=int(need("expert_feed_forward_length")),
                       norm_topk_prob=arch == "qwen3moe")
        else:
            out["num_local_experts"] = int(experts)
        if arch == "qwen2moe":
            out["shared_expert_intermediate_size"] = int(get("expert_shared_feed_forward_length", 0))
    head_dim = kw.get("head_dim") or kw["hidden_size"] // kw["num_attention_heads"]
    if arch in ("gemma2", "gemma3"):
        big = kw["num_hidden_layers"] == _GEMMA_27B_LAYERS[arch]
        out["query_pre_attn_scalar"] = kw["hidden_size"] // kw["num_attention_heads"] if big else head_dim
        out["sliding_window"] = int(need("attention.sliding_window"))
        out["hidden_activation"] = "gelu_pytorch_tanh"
    if arch == "gemma2":
        out["attn_logit_softcapping"] = get("attn_logit_softcapping")
        out["final_logit_softcapping"] = get("final_logit_softcapping")
    if arch == "gemma3":  # the local layers' rope: base 10000, no scaling (llama.cpp's fixed value)
        out["rope_parameters"] = {"full_attention": kw["rope_parameters"],
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    if arch == "phi3":
        rope_dim = get("rope.dimension_count")
        if rope_dim:
            out["partial_rotary_factor"] = int(rope_dim) / head_dim
        if "rope_factors_long.weight" in gguf.tensors:
            original = int(need("rope.scaling.original_context_length"))
            rope = {"rope_type": "longrope", "rope_theta": kw["rope_parameters"]["rope_theta"],
                    "original_max_position_embeddings": original,
                    "long_factor": gguf.dequantize("rope_factors_long.weight").reshape(-1).tolist(),
                    "short_factor": gguf.dequantize("rope_factors_short.weight").reshape(-1).tolist()}
            attn_factor = get("rope.scaling.attn_factor")
            if attn_factor is not None:
                rope["attention_factor"] = float(attn_factor)
            out["rope_parameters"] = rope
            out["original_max_position_embeddings"] = original
    return out


def _rope_parameters(get: Any) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 10000.0))}
    scaling = get("rope.scaling.type")
    factor = get("rope.scaling.factor") or get("rope.scale_linear")
    if scaling in (None, "none") and factor and float(factor) != 1.0:
        scaling = "linear"
    if scaling in ("linear", "yarn") and factor:
        params["rope_type"] = scaling
        params["factor"] = float(factor)
        original = get("rope.scaling.original_context_length")
        if scaling == "yarn" and original:
            params["original_max_position_embeddings"] = int(original)
    elif scaling not in (None, "none"):
        logger.warning("GGUF rope scaling %r is not supported; using plain RoPE", scaling)
    return params
