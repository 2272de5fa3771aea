"""Tiny configs of the dense families (model_registry/models/dense.py), shared by their tests
(test_model_dense_families.py, test_lora_dense_families.py): small sliding windows so that prompts of a few dozen
tokens cross them, and each family's distinctive switches set."""
from __future__ import annotations

BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)


def family_config(name: str):
    import transformers as t

    if name == "qwen3":  # layer 1 slides (layer_types from max_window_layers)
        return t.Qwen3Config(**BASE, head_dim=16, use_sliding_window=True, sliding_window=6, max_window_layers=1)
    if name == "olmo2":  # one KV head: replicated on two ranks, its all-heads k norm counted once
        return t.Olmo2Config(**{**BASE, "num_key_value_heads": 1}, pad_token_id=0)
    if name == "granite":
        return t.GraniteConfig(**BASE, embedding_multiplier=3.0, residual_multiplier=0.6, attention_multiplier=0.2,
                               logits_scaling=2.5)
    if name == "glm4":
        return t.Glm4Config(**BASE, head_dim=16, pad_token_id=0)
    if name == "phi3":  # LongRoPE within its original length (its short factors; the long ones: test_model_rope)
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + i / 8 for i in range(8)],
                "long_factor": [2.0 + i for i in range(8)], "original_max_position_embeddings": 64}
        return t.Phi3Config(**{**BASE, "num_key_value_heads": 4}, pad_token_id=0, sliding_window=7,
                            rope_parameters=rope, original_max_position_embeddings=64)
    if name == "phi4-partial":  # Phi-4-mini's partial rotary: 3/4 of each head
        return t.Phi3Config(**BASE, pad_token_id=0, partial_rotary_factor=0.75)
    if name == "gemma2":
        return t.Gemma2Config(**BASE, head_dim=16, sliding_window=5, query_pre_attn_scalar=24,
                              attn_logit_softcapping=4.0, final_logit_softcapping=6.0)
    if name == "gemma3":  # local, global (linear-scaled rope), local
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}
        return t.Gemma3TextConfig(**{**BASE, "num_hidden_layers": 3}, head_dim=16, sliding_window=5,
                                  query_pre_attn_scalar=24, rope_parameters=rope,
                                  layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    if name == "smollm3":  # layers 1 and 3 without rotary (NoPE)
        return t.SmolLM3Config(**{**BASE, "num_hidden_layers": 4}, no_rope_layer_interval=2, pad_token_id=0)
    if name == "exaone4":  # a sliding layer with rotary, a global layer without (global NoPE)
        return t.Exaone4Config(**BASE, head_dim=16, sliding_window=5, pad_token_id=0,
                               layer_types=["sliding_attention", "full_attention"])
    raise KeyError(name)


ARCH = {"qwen3": "Qwen3ForCausalLM", "olmo2": "Olmo2ForCausalLM", "granite": "GraniteForCausalLM",
        "glm4": "Glm4ForCausalLM", "phi3": "Phi3ForCausalLM", "phi4-partial": "Phi3ForCausalLM",
        "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "smollm3": "SmolLM3ForCausalLM",
        "exaone4": "Exaone4ForCausalLM"}
