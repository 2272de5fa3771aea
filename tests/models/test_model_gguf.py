"""GGUF parsing, config and weight mapping on small GGUF files written here with gguf's own writer."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize
from paged_harness import PagedHarness, assert_matches_hf, run_standard_schedule
from vllite_platform_cpu.attention import TorchPagedAttention

from model_registry.gguf_file import GGUFFile, GGUFFormatError
from model_registry.gguf_weights import hf_name, unpermute_rotary
from model_registry.loader import load_model
from model_registry.models.llama import LlamaForCausalLM
from model_registry.source import load_hf_config, resolve_model_source

torch.set_num_threads(2)

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)
_TO_GGUF = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
            "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
            "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows of "llama" models."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(name: str) -> str:
    m = re.match(r"model\.layers\.(\d+)\.(?:self_attn|mlp)?\.?(\w+)\.(weight|bias)$", name)
    if m:
        return f"blk.{m.group(1)}.{_TO_GGUF[m.group(2)]}.{m.group(3)}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[name]


def _write_gguf(path, arch: str, hf_model, qtypes: dict[str, GGMLQuantizationType]) -> None:
    """Export an HF model the way llama.cpp would (metadata keys, names, q/k permutation for llama)."""
    c = hf_model.config
    w = GGUFWriter(str(path), arch)
    w.add_name("tiny test model")
    w.add_uint32(f"{arch}.context_length", c.max_position_embeddings)
    w.add_uint32(f"{arch}.embedding_length", c.hidden_size)
    w.add_uint32(f"{arch}.feed_forward_length", c.intermediate_size)
    w.add_uint32(f"{arch}.block_count", c.num_hidden_layers)
    w.add_uint32(f"{arch}.attention.head_count", c.num_attention_heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", c.num_key_value_heads)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    w.add_float32(f"{arch}.rope.freq_base", c.rope_parameters["rope_theta"])
    w.add_uint32(f"{arch}.vocab_size", c.vocab_size)
    w.add_uint32("tokenizer.ggml.bos_token_id", 3)
    w.add_uint32("tokenizer.ggml.eos_token_id", 4)
    state = hf_model.state_dict()
    tied = getattr(c, "tie_word_embeddings", False)
    for name, t in state.items():
        if tied and name == "lm_head.weight":
            continue
        data = t.numpy().astype(np.float32)
        gname = _gguf_name(name)
        if arch == "llama" and ".attn_q." in gname:
            data = _permute(data, c.num_attention_heads)
        elif arch == "llama" and ".attn_k." in gname:
            data = _permute(data, c.num_key_value_heads)
        qtype = qtypes.get(gname.rsplit(".", 2)[-2], GGMLQuantizationType.F32) if data.ndim == 2 else \
            GGMLQuantizationType.F32
        w.add_tensor(gname, quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _random_hf(config, seed=0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if name.endswith("norm.weight") else p.normal_(0.0, 0.15)
    return model.eval()


def test_parser_matches_gguf_reader(tmp_path):
    path = tmp_path / "t.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_uint8("k.u8", 7)
    w.add_int16("k.i16", -3)
    w.add_uint64("k.u64", 2**40)
    w.add_float64("k.f64", 0.1)
    w.add_bool("k.bool", True)
    w.add_string("k.str", "héllo")
    w.add_array("k.ints", [1, 2, 3])
    w.add_array("k.strs", ["a", "bc", ""])
    w.add_array("k.floats", [0.5, 1.5])
    rng = np.random.default_rng(0)
    tensors = {"a": (rng.standard_normal((8, 64)).astype(np.float32), GGMLQuantizationType.F32),
               "b": (rng.standard_normal((4, 64)).astype(np.float32), GGMLQuantizationType.F16),
               "c": (rng.standard_normal((3, 64)).astype(np.float32), GGMLQuantizationType.Q8_0),
               "d": (rng.standard_normal((2, 64)).astype(np.float32), GGMLQuantizationType.Q4_1),
               "e": (rng.standard_normal((2, 64)).astype(np.float32), GGMLQuantizationType.BF16)}
    for name, (data, qtype) in tensors.items():
        w.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    ours, ref = GGUFFile(path), GGUFReader(path)
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        value = ours.metadata[key]
        assert (value.tolist() if isinstance(value, np.ndarray) else value) == field.contents(), key
    assert [t.name for t in ref.tensors] == list(ours.tensors)
    for t in ref.tensors:
        assert np.array_equal(ours.raw(t.name), t.data) and ours.raw(t.name).dtype == t.data.dtype
        expect = dequantize(t.data, t.tensor_type).reshape(ours.tensors[t.name].shape)
        assert np.array_equal(ours.dequantize(t.name), expect)
    assert ours.tensors["a"].shape == (8, 64)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(GGUFFormatError, match="not a GGUF"):
        GGUFFile(path)


def test_names_and_unpermute():
    assert hf_name("blk.3.attn_output.weight") == "model.layers.3.self_attn.o_proj.weight"
    assert hf_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert hf_name("output.weight") == "lm_head.weight" and hf_name("rope_freqs.weight") is None
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    assert np.array_equal(unpermute_rotary(_permute(w, 8), 8), w)
    with pytest.raises(ValueError):
        hf_name("blk.0.something_new.weight")


def test_llama_gguf_unpermuted_and_exact(tmp_path):
    """F32 GGUF of a random Llama: llama.cpp's q/k permutation undone, weights bit-identical, logits match."""
    from transformers import LlamaConfig

    hf = _random_hf(LlamaConfig(**TINY, tie_word_embeddings=True))
    _write_gguf(tmp_path / "tiny.gguf", "llama", hf, {})
    source = resolve_model_source(str(tmp_path))
    config = load_hf_config(source)
    assert config.architectures == ["LlamaForCausalLM"] and config.tie_word_embeddings
    assert (config.bos_token_id, config.eos_token_id, config.num_key_value_heads) == (3, 4, 2)
    backend = TorchPagedAttention()
    model = load_model(source, config, LlamaForCausalLM, backend, torch.float32, torch.device("cpu"))
    ref = hf.state_dict()
    attn = model.model.layers[1].self_attn
    assert torch.equal(attn.qkv_proj.weight, torch.cat([ref[f"model.layers.1.self_attn.{x}_proj.weight"]
                                                        for x in "qkv"]))
    gen = torch.Generator().manual_seed(2)
    prompts = {r: torch.randint(0, 256, (n,), generator=gen).tolist() for r, n in (("a", 7), ("b", 10), ("c", 5))}
    harness = PagedHarness(model, backend, num_blocks=32, block_size=4)
    run_standard_schedule(harness, prompts, decode_steps=2)
    assert_matches_hf(harness, hf, atol=1e-4)


def test_qwen2_gguf_quantized_with_bias(tmp_path):
    """qwen2 GGUFs are not permuted and carry q/k/v biases; quantized tensors equal gguf's dequantize."""
    from transformers import Qwen2Config

    hf = _random_hf(Qwen2Config(**TINY, tie_word_embeddings=False))
    qtypes = {"attn_q": GGMLQuantizationType.Q8_0, "ffn_up": GGMLQuantizationType.Q4_0,
              "attn_k": GGMLQuantizationType.F16}
    _write_gguf(tmp_path / "qwen.gguf", "qwen2", hf, qtypes)
    source = resolve_model_source(str(tmp_path / "qwen.gguf"))
    config = load_hf_config(source)
    assert config.architectures == ["Qwen2ForCausalLM"] and not config.tie_word_embeddings
    model = load_model(source, config, LlamaForCausalLM, TorchPagedAttention(), torch.float32, torch.device("cpu"))
    ref = hf.state_dict()
    layer = model.model.layers[0]
    q_ref = ref["model.layers.0.self_attn.q_proj.weight"].numpy()
    expect_q = dequantize(quantize(q_ref, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
    assert np.array_equal(layer.self_attn.qkv_proj.weight[: q_ref.shape[0]].numpy(), expect_q)
    bias = torch.cat([ref[f"model.layers.0.self_attn.{x}_proj.bias"] for x in "qkv"])
    assert torch.equal(layer.self_attn.qkv_proj.bias, bias)
    assert torch.equal(model.lm_head.weight, ref["lm_head.weight"])


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0])
def test_whole_tensor_dequantisation_is_bit_identical_to_gguf(qtype):
    """model_registry.gguf_dequant against gguf's own numpy dequantisation, on blocks gguf quantised."""
    from model_registry.gguf_dequant import dequantize_blocks

    rng = np.random.default_rng(int(qtype))
    w = (rng.standard_normal((48, 96)) * rng.uniform(0.01, 3.0, (48, 1))).astype(np.float32)
    w[3] = 0.0  # an all-zero block row: scale 0
    raw = quantize(w, qtype)
    want = dequantize(raw, qtype).reshape(w.shape)
    got = dequantize_blocks(raw, qtype, w.shape)
    assert got.dtype == torch.float32 and got.shape == w.shape
    assert np.array_equal(got.numpy(), want)
    assert dequantize_blocks(raw, GGMLQuantizationType.Q6_K, w.shape) is None  # left to gguf.quants
