"""quantization="gguf" with K-quants: Q4_K, Q5_K and Q6_K weights computed from their super-blocks.

The repacked records against ``gguf.quants.dequantize`` (the gguf package's own reading of the blocks), bit for
bit; the CPU kernel of each ISA variant this CPU runs against float64 (the dequantised weights times the
unquantized input, within the bound the per-32 int8 activations allow, and the same quantized arithmetic
computed in float64); and a tiny Llama GGUF file written with the gguf package (Q4_K / Q5_K / Q6_K tensors, as a
``Q4_K_M`` file mixes them) run from its blocks against the same file dequantised at load, in float32.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize
from gguf.quants import quantize as gguf_quantize

from model_registry.layers.quantization.gguf import GGUF_GROUP, dequantize_gguf
from model_registry.layers.quantization.kquants import (
    BLOCK_BYTES,
    decode_blocks,
    pack_kquant,
    repack_kquant,
    unpack_kquant,
)
from vllite_core.errors import ConfigError

torch.set_num_threads(1)

KTYPES = ("Q4_K", "Q5_K", "Q6_K")
LOGPROB_TOL = 0.3
TYPE_ID = {"Q4_K": 12, "Q5_K": 13, "Q6_K": 14}


def _random_blocks(qtype: str, n: int, k: int, seed: int) -> np.ndarray:
    """GGUF blocks [N, K / 256 * bytes] with random bytes (every value, scale and high bit) and small fp16 d/dmin."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // 256, BLOCK_BYTES[qtype]), dtype=np.uint8)
    for at in ((208,) if qtype == "Q6_K" else (0, 2)):
        halves = (rng.random((n, k // 256, 1)) * 0.004 + 1e-4).astype(np.float16)
        raw[:, :, at:at + 2] = halves.view(np.uint8)
    return raw.reshape(n, -1)


def _gguf_dequant(raw: np.ndarray, qtype: str, n: int, k: int) -> np.ndarray:
    return dequantize(raw, getattr(GGMLQuantizationType, qtype)).reshape(n, k)


def _quantize_acts(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's activations: per row and 32-block, scale max|x| / 127 in float32 (1 for a zero block), values
    rounded half to even. Returns (xd * xq in float64 [M, K], xd [M, K / 32])."""
    m, k = x.shape
    xb = x.astype(np.float32).reshape(m, k // 32, 32)
    amax = np.abs(xb).max(axis=2)
    xd = np.where(amax > 0, amax / np.float32(127.0), np.float32(1.0)).astype(np.float32)
    xq = np.round(xb / xd[:, :, None])
    return (xq * xd[:, :, None].astype(np.float64)).reshape(m, k), xd


def _variants():
    from vllite_platform_cpu import kernels

    return kernels.host_variants() if kernels.available() else []


def _variant(name: str):
    from vllite_platform_cpu import kernels

    if name not in _variants():
        pytest.skip(f"this CPU does not run the {name} kernels ({kernels.error()})")
    return kernels.load_variant(name)


VARIANTS = ("default", "avx2", "avx512", "avx512_bf16")


@pytest.mark.parametrize("qtype", KTYPES)
def test_repack_matches_gguf_quants(qtype):
    """Random blocks (13 rows: a partial group of 8; 3 super-blocks): the repacked records dequantise to exactly
    gguf.quants' float32 values, give back the same integer fields, and hold the file's bytes within 3%."""
    n, k = 13, 768
    raw = _random_blocks(qtype, n, k, seed=1)
    w = repack_kquant(raw, qtype)
    assert w.shape == (n, k) and w.type_id == TYPE_ID[qtype]
    want = _gguf_dequant(raw, qtype, n, k)
    assert np.array_equal(dequantize_gguf(w).numpy(), want.astype(np.float32))
    a, b = decode_blocks(raw, qtype), unpack_kquant(w)
    for field in ("q", "sc", "mn", "d", "dmin"):
        x, y = getattr(a, field), getattr(b, field)
        assert (x is None and y is None) or np.array_equal(x, y), field
    per_row_file = raw.shape[1]
    per_row_here = w.nbytes() / (w.blocks.shape[0] * GGUF_GROUP)
    assert per_row_here <= 1.03 * per_row_file, (per_row_here, per_row_file)
    pad = w.blocks.numpy().reshape(2, 3, -1)[1]  # the last group's rows 5..7 (past N) are zeros
    assert np.array_equal(dequantize_gguf(pack_kquant(a)).numpy(), dequantize_gguf(w).numpy()) and pad.any()


@pytest.mark.parametrize("qtype", KTYPES)
def test_kernel_repack_is_the_numpy_repack(qtype):
    """The CPU kernels' repack at load (``ModelOps.gguf_repack``): byte for byte the numpy reference's records, for
    random blocks (every value, scale, minimum and high bit; 21 rows: a partial last group; 2 super-blocks)."""
    if not _variants():
        pytest.skip("no CPU kernels")
    from vllite_platform_cpu.model_ops import CpuModelOps

    raw = _random_blocks(qtype, 21, 512, seed=3)
    got = CpuModelOps(fused=True, packed_linear=True).gguf_repack(torch.from_numpy(raw), qtype)
    assert torch.equal(got, pack_kquant(decode_blocks(raw, qtype)).blocks)


def test_k_not_a_multiple_of_256_is_refused():
    f = decode_blocks(_random_blocks("Q4_K", 8, 256, seed=2), "Q4_K")
    bad = type(f)(f.qtype, np.zeros((8, 288), np.uint8), f.sc, f.mn, f.d, f.dmin)
    with pytest.raises(ConfigError, match="multiple of 256"):
        pack_kquant(bad)
    with pytest.raises(ConfigError, match="K-quant"):
        decode_blocks(np.zeros((8, 18), np.uint8), "Q4_0")
    mod = _variant("avx2") if "avx2" in _variants() else None
    if mod is not None:  # the kernel checks its shapes too
        w = repack_kquant(_random_blocks("Q4_K", 8, 256, seed=2), "Q4_K")
        with pytest.raises(RuntimeError, match="256"):
            mod.gguf_linear_x8(torch.empty(1, 8), torch.randn(1, 288), 12, w.blocks, None, 1 << 30, 1 << 30)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("qtype", KTYPES)
@pytest.mark.parametrize("shape", [(37, 256), (13, 768), (64, 2048)])
def test_kernel_matches_float64(variant, qtype, shape):
    """Both paths (int8 activations; with AVX2 also dequantised float32 panels), input rows 1..9, 13, 17 and 70 (row
    tiles of 4 and their remainders), output columns not a multiple of 8 (a partial group) or 16 (a partial
    panel), with and without bias."""
    mod = _variant(variant)
    n, k = shape
    raw = _random_blocks(qtype, n, k, seed=n * k)
    w = repack_kquant(raw, qtype)
    wd = _gguf_dequant(raw, qtype, n, k).astype(np.float64)
    g = torch.Generator().manual_seed(k)
    for rows in (*range(1, 10), 13, 17, 70):
        x = torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 4
        if rows == 5:
            x[2, :32] = 0.0  # an all-zero block: scale 1, values 0
        bias = torch.randn(n, generator=g) if rows % 2 else None
        xn = x.numpy().astype(np.float64)
        b = 0.0 if bias is None else bias.numpy().astype(np.float64)
        exact = xn @ wd.T + b
        xq, xd = _quantize_acts(x.numpy())
        same = xq @ wd.T + b  # the kernel's arithmetic: quantized activations, exact sums
        # |x - xd * xq| <= xd / 2 per element: each output moves by at most sum over blocks of xd / 2 * sum |w|.
        bound = 0.5 * xd.astype(np.float64) @ np.abs(wd).reshape(n, -1, 32).sum(-1).T
        mag = np.abs(xn) @ np.abs(wd).T + np.abs(b)
        for min_rows in (1 << 30, 1):
            out = torch.empty(rows, n)
            mod.gguf_linear_x8(out, x, w.type_id, w.blocks, bias, min_rows, 1 << 30)
            got = out.numpy().astype(np.float64)
            what = f"{variant} {qtype} {shape} {rows} rows, gemm_min_rows {min_rows}"
            if min_rows == 1 and mod.avx2_gemm_available():  # dequantised weights, float32 sums
                np.testing.assert_array_less(np.abs(got - exact), 1e-5 * mag + 1e-6, err_msg=what)
                continue
            np.testing.assert_array_less(np.abs(got - same), 1e-5 * mag + 1e-6, err_msg=what)
            np.testing.assert_array_less(np.abs(got - exact), bound * 1.0001 + 1e-5 * mag + 1e-6, err_msg=what)


@pytest.mark.parametrize("qtype", KTYPES)
def test_kernel_bf16_panels_are_the_dequantised_bf16_gemm(qtype):
    """From gemm_min_rows on, with AVX512-BF16 (AMX tiles where the CPU has them): each panel dequantised from the
    super-blocks and rounded to bfloat16 gives bit for bit the bf16 GEMM on gguf.quants' dequantised weight rounded
    to bfloat16 (the dequantised bf16 model's linear): every value, scale, minimum and high bit of random records
    decoded exactly. 70 columns (a partial group and panel), K of 768 (3 super-blocks), 1-40 rows."""
    variants = [v for v in _variants() if v == "avx512_bf16"]
    if not variants:
        pytest.skip("no AVX512-BF16 CPU kernels here")
    mod = _variant(variants[0])
    n, k = 70, 768
    raw = _random_blocks(qtype, n, k, seed=11)
    w = repack_kquant(raw, qtype)
    wbf = torch.from_numpy(_gguf_dequant(raw, qtype, n, k).astype(np.float32)).bfloat16()
    packed = torch.zeros(-(-n // 32), k // 2, 32, 2, dtype=torch.bfloat16)
    mod.bf16_gemm_pack(packed, wbf)
    g = torch.Generator().manual_seed(3)
    for rows in (1, 13, 40):
        x = (torch.randn(rows, k, generator=g) * 2).bfloat16()
        bias = torch.randn(n, generator=g) if rows % 2 else None
        got, want = torch.empty(rows, n, dtype=torch.bfloat16), torch.empty(rows, n, dtype=torch.bfloat16)
        mod.gguf_linear_x8(got, x, w.type_id, w.blocks, bias, 1, 1 << 30)
        mod.bf16_gemm(want, x, packed, bias)
        assert torch.equal(got, want), (qtype, rows)


@pytest.mark.parametrize("qtype", KTYPES)
def test_kernel_bfloat16_input_and_threads(qtype):
    """bfloat16 in and out: the float32 kernel on the widened input, rounded once (below gemm_min_rows, and at
    every row count on CPUs without AVX512-BF16); and the groups split over 2 threads give the one-thread result
    bit for bit."""
    variants = [v for v in _variants() if v != "default"]
    if not variants:
        pytest.skip("no AVX2 CPU kernels")
    mod = _variant(variants[-1])
    n, k = 70, 512
    w = repack_kquant(_random_blocks(qtype, n, k, seed=5), qtype)
    before = torch.get_num_threads()
    try:
        for rows in (1, 5, 9):
            x = (torch.randn(rows, k) * 2).bfloat16()
            got = torch.empty(rows, n, dtype=torch.bfloat16)
            mod.gguf_linear_x8(got, x, w.type_id, w.blocks, None, 1 << 30, 1 << 30)
            one, two = torch.empty(rows, n), torch.empty(rows, n)
            torch.set_num_threads(1)
            mod.gguf_linear_x8(one, x.float(), w.type_id, w.blocks, None, 1 << 30, 1 << 30)
            assert torch.equal(got, one.bfloat16()), rows
            torch.set_num_threads(2)
            mod.gguf_linear_x8(two, x.float(), w.type_id, w.blocks, None, 1 << 30, 1)
            assert torch.equal(one, two), rows
    finally:
        torch.set_num_threads(before)


# --- a tiny Llama GGUF with K-quant tensors -----------------------------------------------------------------------

def _quantize_q45k(w: np.ndarray, bits: int) -> np.ndarray:
    """Our own simple Q4_K / Q5_K quantizer (min/max per 32, scales to 6 bits): GGUF's block bytes [N, ...]."""
    qmax = (1 << bits) - 1
    n, k = w.shape
    x = w.reshape(n, k // 256, 8, 32).astype(np.float32)
    lo, hi = np.minimum(x.min(-1), 0.0), np.maximum(x.max(-1), 0.0)
    scale, mins = (hi - lo) / qmax, -lo
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (mins.max(-1) / 63).astype(np.float16)
    df, dmf = np.maximum(d.astype(np.float32), 1e-12), np.maximum(dmin.astype(np.float32), 1e-12)
    sc = np.clip(np.round(scale / df[..., None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(mins / dmf[..., None]), 0, 63).astype(np.uint8)
    step = np.maximum(d.astype(np.float32)[..., None] * sc, 1e-12)[..., None]
    q = np.clip(np.round((x + (dmin.astype(np.float32)[..., None] * m)[..., None]) / step), 0, qmax).astype(np.uint8)
    q = q.reshape(n, k // 256, 256)
    scales = np.concatenate(((sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6),
                             (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)), axis=-1).astype(np.uint8)
    pairs = q.reshape(n, k // 256, 4, 2, 32)
    qs = ((pairs[:, :, :, 0] & 15) | ((pairs[:, :, :, 1] & 15) << 4)).reshape(n, k // 256, 128)
    parts = [d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), scales]
    if bits == 5:
        hb = ((q.reshape(n, k // 256, 8, 32) >> 4) & 1).astype(np.uint16) << np.arange(8).reshape(8, 1)
        parts.append(hb.sum(axis=2).astype(np.uint8))
    parts.append(qs.astype(np.uint8))
    return np.concatenate(parts, axis=-1).reshape(n, -1)


def _quantize_q6k(w: np.ndarray) -> np.ndarray:
    """Our own simple Q6_K quantizer (absmax per 16, int8 scales): GGUF's block bytes [N, ...]."""
    n, k = w.shape
    x = w.reshape(n, k // 256, 16, 16).astype(np.float32)
    scale = np.abs(x).max(-1) / 31
    d = (scale.max(-1) / 127).astype(np.float16)
    sc = np.clip(np.round(scale / np.maximum(d.astype(np.float32), 1e-12)[..., None]), -128, 127).astype(np.int8)
    step = np.maximum(d.astype(np.float32)[..., None] * sc, 1e-12)[..., None]
    q = (np.clip(np.round(x / step), -32, 31) + 32).astype(np.uint8).reshape(n, k // 256, 2, 128)
    ql = (q[..., :64] & 15) | ((q[..., 64:] & 15) << 4)  # [n, s, h, 64]
    qh = sum(((q[..., 32 * s:32 * s + 32] >> 4) & 3) << (2 * s) for s in range(4)).astype(np.uint8)
    parts = [ql.reshape(n, -1, 128), qh.reshape(n, -1, 64), sc.view(np.uint8), d[..., None].view(np.uint8)]
    return np.concatenate(parts, axis=-1).reshape(n, -1)


def _quantize(w: np.ndarray, qtype: str) -> np.ndarray:
    return _quantize_q6k(w) if qtype == "Q6_K" else _quantize_q45k(w, 4 if qtype == "Q4_K" else 5)


def test_own_quantizers_write_what_gguf_reads():
    """The fixture's quantizers against the gguf package's dequantisation: each type reproduces its input to
    within its step (so the fixture's bytes are laid out as GGUF defines them)."""
    w = np.random.default_rng(0).standard_normal((24, 512)).astype(np.float32) * 0.15
    for qtype, tol in (("Q4_K", 0.2), ("Q5_K", 0.1), ("Q6_K", 0.05)):
        raw = _quantize(w, qtype)
        assert raw.shape == (24, 2 * BLOCK_BYTES[qtype])
        back = _gguf_dequant(raw, qtype, 24, 512)
        err = np.abs(back - w).max() / np.abs(w).max()
        assert err < tol, (qtype, err)


_TO_GGUF = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
            "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
            "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
# A Q4_K_M-like mix: Q6_K for the output and the down projections, Q5_K for v, Q4_K elsewhere.
_MIX = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q5_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K",
        "ffn_up": "Q4_K", "ffn_down": "Q6_K", "output": "Q6_K"}


def _write_kquant_gguf(path, mix: dict[str, str] = _MIX) -> None:
    """A random tiny Llama (hidden 256, intermediate 512: rows of whole super-blocks) exported as llama.cpp does
    (q/k rows permuted), with ``mix``'s tensor types (K-quants in our quantizers, others in gguf.quants')."""
    import re

    shapes = {"self_attn.q_proj": (256, 256), "self_attn.k_proj": (128, 256), "self_attn.v_proj": (128, 256),
              "self_attn.o_proj": (256, 256), "mlp.gate_proj": (512, 256), "mlp.up_proj": (512, 256),
              "mlp.down_proj": (256, 512), "input_layernorm": (256,), "post_attention_layernorm": (256,)}
    tensors = [("model.embed_tokens.weight", (512, 256))]
    tensors += [(f"model.layers.{i}.{part}.weight", shape) for i in range(2) for part, shape in shapes.items()]
    tensors += [("model.norm.weight", (256,)), ("lm_head.weight", (512, 256))]  # Hugging Face's order
    w = GGUFWriter(str(path), "llama")
    w.add_name("tiny k-quant model")
    for key, v in (("context_length", 128), ("embedding_length", 256), ("feed_forward_length", 512),
                   ("block_count", 2), ("attention.head_count", 4), ("attention.head_count_kv", 2),
                   ("vocab_size", 512)):
        w.add_uint32(f"llama.{key}", v)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    gen = torch.Generator().manual_seed(0)
    for name, shape in tensors:
        if name.endswith("norm.weight"):
            data = (torch.rand(shape, generator=gen) + 0.5).numpy()
        else:
            std = 0.15 if "embed" in name else 0.25 if "lm_head" in name else 0.06  # a peaked next-token choice
            data = (torch.randn(shape, generator=gen) * std).numpy()
        m = re.match(r"model\.layers\.(\d+)\.(?:self_attn|mlp)?\.?(\w+)\.weight$", name)
        gname = f"blk.{m.group(1)}.{_TO_GGUF[m.group(2)]}.weight" if m else {
            "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[name]
        part = gname.split(".")[-2]
        heads = {"attn_q": 4, "attn_k": 2}.get(part)
        if heads:  # llama.cpp's converter's row order for rotary
            data = data.reshape(heads, 2, data.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(data.shape)
        qtype = mix.get(part)
        if qtype is None:
            w.add_tensor(gname, data)
        else:
            gtype = getattr(GGMLQuantizationType, qtype)
            raw = _quantize(data, qtype) if qtype in KTYPES else gguf_quantize(np.ascontiguousarray(data), gtype)
            w.add_tensor(gname, raw, raw_dtype=gtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("kquant-gguf") / "tiny-q4_k_m.gguf"
    _write_kquant_gguf(path)
    return str(path)


def test_engine_kquants_from_blocks_match_the_dequantised_model(kquant_gguf, tiny_path, monkeypatch):
    """quantization="gguf" on the K-quant file: every linear layer and the LM head keep their Q4_K/Q5_K/Q6_K
    blocks (a fused layer whose shards differ in type, one weight per shard), the same weights, bit for bit, as
    the load dequantises, within 3% of the file's bytes; and the greedy tokens are those of the same file
    dequantised to float32: with the kernel's int8 activations per 32 values (decode and short prompts) logprobs
    within LOGPROB_TOL (measured: all 48 tokens equal, logprobs within 0.19), a token differing only where the
    reference's top two were within twice that (a near-tie; the texts differ after it) and 3/4 of the tokens
    compared equal; through the dequantised float32 panels, every token equal, logprobs within 1e-3."""
    from model_registry.gguf_file import GGUFFile
    from vllite_core import LLM, SamplingParams

    if not _variants():
        pytest.skip("no CPU kernels")
    prompts = [{"prompt_token_ids": [1, 17 + 31 * i, 200 - 7 * i, 300 + i, 42]} for i in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    args = dict(model=kquant_gguf, tokenizer=tiny_path, dtype="float32", num_threads=1, max_model_len=64,
                enable_prefix_caching=False)
    dense = LLM(**args)
    base = dense.generate(prompts, sp)
    dense_model = dense.llm_engine.core.engine_core.worker.runner.model
    dense_w = {n: m.weight.detach().clone() for n, m in dense_model.named_modules() if hasattr(m, "checkpoint_names")}
    dense_head = dense_model.lm_head.weight.detach().clone()
    del dense, dense_model
    llm = LLM(**args, quantization="gguf")
    model = llm.llm_engine.core.engine_core.worker.runner.model
    layers = {n: m for n, m in model.named_modules() if hasattr(m, "checkpoint_names")}
    assert len(layers) == 4 * 2 and all(m.quant_method.name == "gguf" for m in layers.values())
    parts = {n: getattr(m.quant_method, "parts", None) or [m.quant_method.gguf_weight] for n, m in layers.items()}
    kinds = {n: [w.qtype for w in p] for n, p in parts.items()}
    assert kinds["model.layers.0.mlp.down_proj"] == ["Q6_K"] and kinds["model.layers.1.self_attn.o_proj"] == ["Q4_K"]
    assert kinds["model.layers.0.mlp.gate_up_proj"] == ["Q4_K"]  # both shards Q4_K: one weight
    assert kinds["model.layers.1.self_attn.qkv_proj"] == ["Q4_K", "Q4_K", "Q5_K"]  # q, k, v: one weight each
    for n, p in parts.items():
        assert torch.equal(torch.cat([dequantize_gguf(w) for w in p]), dense_w[n]), n
    head = model.lm_head.quant_method.gguf_weight
    assert head.qtype == "Q6_K" and torch.equal(dequantize_gguf(head), dense_head)
    f = GGUFFile(kquant_gguf)
    file_bytes = sum(np.asarray(f.raw(name)).nbytes for name, info in f.tensors.items()
                     if info.ggml_type.name in _MIX.values())
    held = sum(w.nbytes() for p in parts.values() for w in p) + head.nbytes()
    assert held <= 1.03 * file_bytes, (held, file_bytes)
    out = llm.generate(prompts, sp)
    same = 0
    for a, b in zip(base, out):
        for i, (ta, tb) in enumerate(zip(a.outputs[0].token_ids, b.outputs[0].token_ids)):
            ref, got = a.outputs[0].logprobs[i], b.outputs[0].logprobs[i]
            if ta != tb:  # only where the reference's own choice was a near-tie, after which the texts differ
                assert ref[ta].logprob - ref[tb].logprob < 2 * LOGPROB_TOL, (i, ta, tb, ref, got)
                break
            assert abs(got[tb].logprob - ref[ta].logprob) < LOGPROB_TOL, (i, ref, got)
            same += 1
    assert same >= 0.75 * len(prompts) * sp.max_tokens, same
    # Every row count through the dequantised float32 panels (GGUF_GEMM_MIN_ROWS = 1: unquantized activations):
    # the dequantised model's arithmetic up to the order of float32 sums, so its tokens exactly.
    from vllite_platform_cpu import kernels

    monkeypatch.setattr(kernels, "GGUF_GEMM_MIN_ROWS", 1)
    for a, b in zip(base, llm.generate(prompts, sp)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for ref, got, t in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids):
            assert abs(ref[t].logprob - got[t].logprob) < 1e-3


@pytest.mark.parametrize("qtype", ("Q4_0", "Q4_1", "Q8_0", *KTYPES))
def test_rows_of_blocks_are_the_dequantised_table_rows(qtype):
    """An embedding looked up in its blocks: the CPU kernel's rows (float32: every bit; bfloat16: the float32 value
    rounded as torch rounds it) and the reference op's are rows of gguf.quants' dequantised table, for ids in any
    order, repeated, in the last group of 8 (N = 37: a partial group) and in every group."""
    from model_registry.layers.quantization.gguf import repack
    from vllite_core.model_ops import ModelOps

    n, k = 37, 512
    if qtype in KTYPES:
        raw = _random_blocks(qtype, n, k, seed=5)
    else:
        x = np.random.default_rng(5).standard_normal((n, k)).astype(np.float32)
        raw = gguf_quantize(x, getattr(GGMLQuantizationType, qtype))
    w = repack(raw, qtype)
    table = torch.from_numpy(_gguf_dequant(raw, qtype, n, k).astype(np.float32))
    ids = torch.tensor([36, 0, 5, 5, 35, 8, 17, 36, 1] + list(range(0, n, 3)))
    for dtype in (torch.float32, torch.bfloat16):
        want = table[ids].to(dtype)
        assert torch.equal(ModelOps().gguf_embedding(ids.view(2, -1), w, dtype), want.view(2, -1, k))
        if _variants():
            from vllite_platform_cpu import kernels

            got = torch.empty(len(ids), k, dtype=dtype)
            kernels.gguf_rows(got, ids, TYPE_ID.get(qtype, {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}.get(qtype)), w.blocks)
            assert torch.equal(got, want), (qtype, dtype)
    if _variants():
        with pytest.raises(RuntimeError, match="outside the table"):
            kernels.gguf_rows(torch.empty(1, k), torch.tensor([40]), w.type_id, w.blocks)


def test_load_reads_blocks_only_and_a_dense_layer_its_floats(tmp_path, tiny_path, monkeypatch):
    """quantization="gguf" loads without dequantising the projection tensors it keeps as blocks: here only the
    fused qkv layer, whose v tensor is Q5_0 (no kernel, so the layer stays dense), reads its q and k K-quants as
    floats, after the blocks were chosen; the Q4_K embedding is looked up in its blocks (no float table); every
    layer's weights and every embedding row are those of the same file dequantised at load, bit for bit, and the
    greedy tokens through the dequantised float32 panels are the dense model's."""
    from model_registry.gguf_file import GGUFFile
    from vllite_core import LLM, SamplingParams

    if not _variants():
        pytest.skip("no CPU kernels")
    path = tmp_path / "tiny-v-q5_0.gguf"
    _write_kquant_gguf(path, {**_MIX, "attn_v": "Q5_0", "token_embd": "Q4_K"})
    args = dict(model=str(path), tokenizer=tiny_path, dtype="float32", num_threads=1, max_model_len=64,
                enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": [1, 17 + 31 * i, 200 - 7 * i, 42]} for i in range(3)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    dense = LLM(**args)
    base = dense.generate(prompts, sp)
    dense_model = dense.llm_engine.core.engine_core.worker.runner.model
    dense_w = {n: m.weight.detach().clone() for n, m in dense_model.named_modules() if hasattr(m, "checkpoint_names")}
    dense_table = dense_model.model.embed_tokens.weight.detach().clone()
    del dense, dense_model
    read: list[str] = []
    real = GGUFFile.dequantize
    monkeypatch.setattr(GGUFFile, "dequantize", lambda self, name: read.append(name) or real(self, name))
    llm = LLM(**args, quantization="gguf")
    model = llm.llm_engine.core.engine_core.worker.runner.model
    layers = {n: m for n, m in model.named_modules() if hasattr(m, "checkpoint_names")}
    dense_layers = sorted(n for n, m in layers.items() if m.quant_method.name != "gguf")
    assert dense_layers == ["model.layers.0.self_attn.qkv_proj", "model.layers.1.self_attn.qkv_proj"]
    projections = [name for name in read if name.startswith("blk.")
                   and not name.endswith("norm.weight")]
    assert sorted(projections) == sorted(f"blk.{i}.attn_{p}.weight" for i in range(2) for p in "qkv"), read
    assert read.index("blk.0.attn_q.weight") > read.index("blk.1.attn_v.weight")  # q, k: after the blocks
    emb = model.model.embed_tokens
    assert emb.blocks.qtype == "Q4_K" and emb.weight.numel() == 0 and "token_embd.weight" not in read
    with torch.inference_mode():
        assert torch.equal(emb(torch.arange(dense_table.shape[0])), dense_table)
    for n, m in layers.items():
        if n in dense_layers:
            assert torch.equal(m.weight, dense_w[n]), n
        else:
            w = getattr(m.quant_method, "parts", None) or [m.quant_method.gguf_weight]
            assert torch.equal(torch.cat([dequantize_gguf(x) for x in w]), dense_w[n]), n
    from vllite_platform_cpu import kernels

    monkeypatch.setattr(kernels, "GGUF_GEMM_MIN_ROWS", 1)
    for a, b in zip(base, llm.generate(prompts, sp)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
