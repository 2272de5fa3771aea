"""RoPE frequencies and tables against transformers' own rope init functions."""
from __future__ import annotations

import pytest
import torch

from model_registry.layers.rotary import RotaryEmbedding, rope_parameters

torch.set_num_threads(2)

VARIANTS = [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
     "beta_fast": 16, "beta_slow": 2, "mscale": 0.7, "mscale_all_dim": 1.0},
]


def _config(rope):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=128, num_attention_heads=2, max_position_embeddings=256,
                       rope_parameters=dict(rope))


@pytest.mark.parametrize("rope", VARIANTS, ids=lambda r: r["rope_type"])
def test_tables_equal_transformers(rope):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = _config(rope)
    ours = RotaryEmbedding(config, 64)
    ref = LlamaRotaryEmbedding(config)
    pos = torch.arange(0, 256)
    cos, sin = ref(torch.zeros(1, dtype=torch.float32), pos[None])
    assert torch.equal(ours.cos_cache[:256], cos[0]) and torch.equal(ours.sin_cache[:256], sin[0])


def test_legacy_rope_scaling_and_theta_attributes():
    from types import SimpleNamespace

    cfg = SimpleNamespace(rope_theta=1e6, rope_scaling={"type": "linear", "factor": 2.0}, max_position_embeddings=8)
    assert rope_parameters(cfg) == {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}


def test_tables_grow_on_demand():
    rope = RotaryEmbedding(_config(VARIANTS[0]), 64)
    assert rope.cos_cache.shape[0] == 256
    cos, _ = rope.lookup(torch.tensor([3, 300]), torch.float32)
    assert cos.shape == (2, 64)
    assert rope.cos_cache.shape[0] >= 301
    fresh = RotaryEmbedding(_config(VARIANTS[0]), 64)
    fresh.ensure_positions(1024)
    assert torch.equal(rope.cos_cache[:301], fresh.cos_cache[:301])


def test_dynamic_beyond_trained_length_uses_scaled_base():
    rope = RotaryEmbedding(_config(VARIANTS[2]), 64)
    rope.ensure_positions(512)
    plain = RotaryEmbedding(_config(VARIANTS[0]), 64)
    plain.ensure_positions(512)
    assert torch.equal(rope.cos_cache[:256], plain.cos_cache[:256])
    assert not torch.allclose(rope.cos_cache[256:512], plain.cos_cache[256:512])


def test_unsupported_rope_type():
    from vllite_core.errors import ConfigError

    with pytest.raises(ConfigError, match="rope_type 'su'"):
        RotaryEmbedding(_config({"rope_type": "su", "rope_theta": 1e4}), 64)
    from types import SimpleNamespace

    # A config transformers did not validate (a GGUF's, a hand-written one) lacking a field its rope type needs.
    bare = SimpleNamespace(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 32,
                                            "original_max_position_embeddings": 64}, max_position_embeddings=256)
    with pytest.raises(ConfigError, match="long_factor"):
        RotaryEmbedding(bare, 64)


def test_longrope_short_and_long_tables_match_transformers():
    """Phi-3's LongRoPE: positions below original_max_position_embeddings rotate by transformers' short-factor
    frequencies, positions from it by its long-factor ones (what HF uses once a sequence is longer; a paged
    engine does not recompute earlier keys, as HF's generate does when it crosses), both scaled by its
    attention factor."""
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + i / 8 for i in range(24)],
            "long_factor": [2.0 + i for i in range(24)], "original_max_position_embeddings": 32,
            "partial_rotary_factor": 0.75}
    config = Phi3Config(hidden_size=128, num_attention_heads=2, max_position_embeddings=256, rope_parameters=rope,
                        original_max_position_embeddings=32, partial_rotary_factor=0.75)
    ours = RotaryEmbedding(config, 64, rotary_dim=48)
    ours.ensure_positions(64)
    for seq_len, rows in ((None, slice(0, 32)), (33, slice(32, 64))):
        inv_freq, scaling = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=seq_len)
        pos = torch.arange(rows.start, rows.stop).float()
        emb = torch.cat([pos[:, None] * inv_freq[None, :]] * 2, dim=-1)
        torch.testing.assert_close(ours.cos_cache[rows], emb.cos() * scaling, atol=1e-6, rtol=0)
        torch.testing.assert_close(ours.sin_cache[rows], emb.sin() * scaling, atol=1e-6, rtol=0)
