"""model_registry.layers, one layer at a time, against float64 references written here (or transformers' own
modules where they exist), on shapes with remainders."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from model_registry.layers import (
    Attention,
    GemmaRMSNorm,
    LayerNorm,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    ReplicatedLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    apply_rotary,
    gated,
    get_act_fn,
    load_parameter,
)
from model_registry.layers.quantization.gguf import GGUFLinearMethod, dequantize_gguf, pack_gguf
from model_registry.layers.quantization.int8 import Int8LinearMethod
from vllite_core.attention.reference import ReferenceAttention
from vllite_core.model_ops import ModelOps

G = torch.Generator().manual_seed(0)


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=G)


def filled(layer: torch.nn.Module, **tensors: torch.Tensor) -> torch.nn.Module:
    for name, t in tensors.items():
        load_parameter(getattr(layer, name), t, None, name)
    return layer


# ---- linear layers and their quantization methods --------------------------------------------------------------

@pytest.mark.parametrize("rows,k,n", [(1, 8, 3), (5, 37, 13), (17, 64, 40)])
def test_replicated_linear_is_x_wt_plus_b(rows, k, n):
    w, b, x = randn(n, k), randn(n), randn(rows, k)
    layer = filled(ReplicatedLinear(k, n, True, torch.float32), weight=w, bias=b)
    want = x.double() @ w.double().T + b.double()
    torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-5)


def test_merged_and_qkv_layers_place_each_checkpoint_tensor_in_its_rows():
    gate, up, x = randn(7, 11), randn(7, 11), randn(3, 11)
    merged = MergedColumnParallelLinear(11, {"gate": 7, "up": 7}, False, torch.float32)
    load_parameter(merged.weight, up, "up", "up_proj.weight")  # any order
    load_parameter(merged.weight, gate, "gate", "gate_proj.weight")
    want = torch.cat([x.double() @ gate.double().T, x.double() @ up.double().T], dim=-1)
    torch.testing.assert_close(merged(x).double(), want, rtol=1e-5, atol=1e-5)
    assert merged.checkpoint_names == {"gate": "gate_proj.weight", "up": "up_proj.weight"}
    stacked = MergedColumnParallelLinear(11, {"gate": 7, "up": 7}, False, torch.float32)
    load_parameter(stacked.weight, torch.cat([gate, up]), None, "input_linear.weight")  # one stacked tensor
    assert torch.equal(stacked.weight, merged.weight)
    with pytest.raises(ValueError, match=r"weight input_linear\.weight: checkpoint shape \(13, 11\)"):
        load_parameter(stacked.weight, randn(13, 11), None, "input_linear.weight")

    head, heads, kv_heads, hidden = 4, 6, 2, 10
    q, k, v = randn(heads * head, hidden), randn(kv_heads * head, hidden), randn(kv_heads * head, hidden)
    qkv = QKVParallelLinear(hidden, head, heads, kv_heads, False, torch.float32)
    for shard, t in (("q", q), ("k", k), ("v", v)):
        load_parameter(qkv.weight, t, shard, f"{shard}_proj.weight")
    xs = randn(2, hidden)
    torch.testing.assert_close(qkv(xs), xs @ torch.cat([q, k, v]).T)


def test_a_checkpoint_tensor_of_the_wrong_shape_names_itself():
    layer = RowParallelLinear(12, 5, False, torch.float32)
    with pytest.raises(ValueError, match=r"weight o_proj\.weight: checkpoint shape \(5, 11\)"):
        load_parameter(layer.weight, randn(5, 11), None, "o_proj.weight")


@pytest.mark.parametrize("rows,k,n", [(1, 4, 3), (5, 36, 13), (9, 64, 33)])
def test_int8_method_is_the_w8a8_formula(rows, k, n):
    """Weights per output row, activations per input row, both symmetric to 127 with round-half-even; the int8
    products summed exactly; the bias added after scaling."""
    w, b, x = randn(n, k), randn(n), randn(rows, k)
    layer = filled(ReplicatedLinear(k, n, True, torch.float32, ops=ModelOps()), weight=w, bias=b)
    Int8LinearMethod.quantize(layer)
    assert layer.weight.dtype == torch.int8 and layer.quant_method.name == "int8"

    def q(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = t.double()
        s = t.abs().amax(-1) / 127
        return torch.round(t / s[:, None]).clamp(-127, 127), s

    wq, ws = q(w)
    xq, xs = q(x)
    want = (xq @ wq.T) * xs[:, None] * ws[None, :] + b.double()
    torch.testing.assert_close(layer(x).double(), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(layer.weight.double(), wq) and layer.quant_method.weight_bytes(layer) == n * k + 4 * n
    err = (layer(x).double() - (x.double() @ w.double().T + b.double())).abs().max()
    assert err < 0.05 * math.sqrt(k)  # and close to the float product


def test_gguf_method_computes_from_the_blocks():
    n, k = 13, 64  # 13 rows: the last group of 8 padded
    qs = torch.randint(-127, 128, (n, k), generator=G, dtype=torch.int64).to(torch.int8)
    d = (torch.rand(n, k // 32, generator=G) * 0.02 + 0.001).half().float()
    w = pack_gguf("Q8_0", qs, d)
    layer = ReplicatedLinear(k, n, False, torch.float32, ops=ModelOps())
    GGUFLinearMethod.use_blocks(layer, w)
    x = randn(3, k)
    dense = (qs.double().view(n, -1, 32) * d.double()[:, :, None]).reshape(n, k)
    torch.testing.assert_close(dequantize_gguf(w).double(), dense)
    torch.testing.assert_close(layer(x).double(), x.double() @ dense.T, rtol=1e-5, atol=1e-5)
    assert layer.weight is not None and layer.weight.dtype == torch.uint8  # the float copy dropped


# ---- vocabulary ---------------------------------------------------------------------------------------------------

def test_embedding_and_tied_head():
    table, h = randn(19, 6), randn(4, 6)
    emb = filled(VocabParallelEmbedding(19, 6, torch.float32), weight=table)
    ids = torch.tensor([0, 18, 5, 5])
    assert torch.equal(emb(ids), table[ids])
    head = ParallelLMHead(19, 6, torch.float32, tied=emb)
    assert head.weight is emb.weight and head.tied
    torch.testing.assert_close(head(h).double(), h.double() @ table.double().T, rtol=1e-5, atol=1e-5)
    Int8LinearMethod.quantize_head(head)  # an int8 copy: the table stays for the lookup
    assert emb.weight.dtype == torch.float32 and head.quant_method.qweight.dtype == torch.int8


# ---- norms and activations ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_llamas_order(dtype):
    x, w = randn(5, 24).to(dtype), (randn(24) + 1).to(dtype)
    norm = filled(RMSNorm(24, 1e-6, dtype, ops=ModelOps()), weight=w)
    h = x.double()
    want = w.double() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype).double()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(norm(x).double(), want, rtol=tol, atol=tol)
    r = randn(5, 24).to(dtype)
    out, res = norm.add_forward(x.clone(), r.clone())
    torch.testing.assert_close(res, x + r)
    torch.testing.assert_close(out, norm(x + r))


def test_gemma_norm_matches_transformers():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm as HFGemmaRMSNorm

    x, w = randn(3, 16).bfloat16(), (randn(16) * 0.1).bfloat16()
    ours = filled(GemmaRMSNorm(16, 1e-6, torch.bfloat16), weight=w)
    ref = HFGemmaRMSNorm(16, eps=1e-6).bfloat16()
    ref.weight.data.copy_(w)
    assert torch.equal(ours(x), ref(x))


def test_layer_norm_with_and_without_bias():
    x, w, b = randn(4, 10), randn(10), randn(10)
    h = x.double()
    base = (h - h.mean(-1, keepdim=True)) / torch.sqrt(h.var(-1, unbiased=False, keepdim=True) + 1e-5)
    with_bias = filled(LayerNorm(10, torch.float32), weight=w, bias=b)
    torch.testing.assert_close(with_bias(x).double(), base * w.double() + b.double(), rtol=1e-5, atol=1e-5)
    without = filled(LayerNorm(10, torch.float32, bias=False), weight=w)
    torch.testing.assert_close(without(x).double(), base * w.double(), rtol=1e-5, atol=1e-5)


def test_activations_by_hf_name():
    x = randn(3, 8)
    assert torch.equal(get_act_fn("silu")(x), F.silu(x))
    torch.testing.assert_close(get_act_fn("gelu_pytorch_tanh")(x).double(),
                               0.5 * x.double() * (1 + torch.tanh(math.sqrt(2 / math.pi)
                                                                  * (x.double() + 0.044715 * x.double() ** 3))))
    torch.testing.assert_close(gated("silu", x), F.silu(x[:, :4]) * x[:, 4:])
    with pytest.raises(NotImplementedError, match="activation 'nope'"):
        get_act_fn("nope")


# ---- rotary embeddings -----------------------------------------------------------------------------------------

def _rotate_ref(x: torch.Tensor, pos: torch.Tensor, base: float, rd: int) -> torch.Tensor:
    """NeoX rotation of the first ``rd`` columns in float64; the rest passed through."""
    inv = 1.0 / base ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    ang = pos.double()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    r = x.double()[..., :rd]
    rot = torch.cat([-r[..., rd // 2:], r[..., :rd // 2]], -1)
    return torch.cat([r * cos + rot * sin, x.double()[..., rd:]], -1)


@pytest.mark.parametrize("rotary_dim,base", [(None, None), (8, None), (8, 1_000_000.0)])
def test_rotary_full_partial_and_own_base(rotary_dim, base):
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=10000.0, max_position_embeddings=64)
    rope = RotaryEmbedding(cfg, 16, rotary_dim=rotary_dim, base=base)
    pos = torch.tensor([0, 3, 17, 63, 70])  # past the table: grown on demand
    q, k = randn(5, 4, 16), randn(5, 2, 16)
    cos, sin = rope.lookup(pos, torch.float32)
    assert cos.shape == (5, rotary_dim or 16)
    got_q, got_k = apply_rotary(ModelOps(), q.clone(), k.clone(), cos, sin)
    for got, x in ((got_q, q), (got_k, k)):
        want = _rotate_ref(x, pos, base or 10000.0, rotary_dim or 16)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


# ---- attention -----------------------------------------------------------------------------------------------

def test_attention_declares_its_cache():
    backend = ReferenceAttention()
    full = Attention(4, 2, 8, backend)
    window = Attention(4, 2, 8, backend, scale=0.5, sliding_window=32)
    assert full.scale == 8 ** -0.5 and window.scale == 0.5
    f, w = full.kv_cache_spec(16, torch.bfloat16), window.kv_cache_spec(16, torch.bfloat16)
    assert (f.kind, f.num_kv_heads, f.head_size, f.block_size) == ("full_attention", 2, 8, 16)
    assert (w.kind, w.sliding_window) == ("sliding_window", 32)


def test_hybrid_loading_fills_fused_projections_and_counts_them_once_whole():
    """A hybrid checkpoint's separate q/k/v and gate/up tensors land in their fused parameter's rows, which
    counts as loaded only when every shard arrived (a missing one stays a missing weight)."""
    from transformers import JambaConfig

    from model_registry.models.jamba import JambaForCausalLM

    cfg = JambaConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                      expert_layer_offset=0, num_experts=2, num_experts_per_tok=1, mamba_d_state=4, mamba_d_conv=4,
                      mamba_expand=2)
    model = JambaForCausalLM(cfg, ReferenceAttention(), torch.float32)
    pre = "model.layers.1."
    hf = {f"{pre}self_attn.{p}_proj.weight": randn(n, 16) for p, n in (("q", 16), ("k", 8), ("v", 8))}
    hf |= {f"{pre}feed_forward.{p}_proj.weight": randn(24, 16) for p in ("gate", "up")}
    loaded = model.load_weights(list(hf.items()))
    assert {f"{pre}self_attn.qkv_proj.weight", f"{pre}feed_forward.gate_up_proj.weight"} <= loaded
    assert not any("q_proj" in n or "gate_proj" in n for n in loaded)
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].feed_forward
    assert torch.equal(attn.qkv_proj.weight, torch.cat([hf[f"{pre}self_attn.{p}_proj.weight"] for p in "qkv"]))
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat([hf[f"{pre}feed_forward.{p}_proj.weight"]
                                                           for p in ("gate", "up")]))
    partial = model.load_weights([(n, t) for n, t in hf.items() if "v_proj" not in n])
    assert f"{pre}self_attn.qkv_proj.weight" not in partial
