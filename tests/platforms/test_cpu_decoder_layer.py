"""The CPU platform's one-call decoder layer (csrc/decoder.cpp) against the layer's own Python path.

The reference is the Python path of the same layer (``LlamaDecoderLayer.forward`` through ``CpuModelOps``), whose
numerics the HF-reference tests check: the C++ call composes the same kernels, so hidden states, residual and
the paged cache it writes must be equal bit for bit, for float32, bfloat16 and GGUF layers, Llama (GQA) and
Qwen2 (qkv bias), decode and prefill rows mixed, int8 (W8A8) layers where the int8 GEMM is built, and
pre-quantized int4 (W4A16: int8 activations in bf16, float ones in float32) and fp8 (fp8 activations per token and
group) layers. Where its conditions do not hold (LoRA, float8 cache, int8 without the int8 GEMM, grad, another
ModelOps) the call declines and the layer runs its Python code.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

kernels = pytest.importorskip("vllite_platform_cpu.kernels")
if not kernels.available():
    pytest.skip(f"CPU kernels not built here: {kernels.error()}", allow_module_level=True)

from transformers import JambaConfig, LlamaConfig, MistralConfig, Qwen2Config  # noqa: E402
from vllite_platform_cpu import decoder_layer  # noqa: E402
from vllite_platform_cpu.attention import TorchPagedAttention  # noqa: E402
from vllite_platform_cpu.decoder_layer import NativeDecoderStack  # noqa: E402
from vllite_platform_cpu.isa import NAMES  # noqa: E402
from vllite_platform_cpu.model_ops import CpuModelOps  # noqa: E402
from vllite_platform_cpu.platform import has_fast_bf16, use_avx2_gemm, use_bf16_gemm, use_int8_gemm  # noqa: E402

from model_registry.layers import HybridStep, RMSNorm, RotaryEmbedding  # noqa: E402
from model_registry.layers.fast_path import report_fast_paths  # noqa: E402
from model_registry.layers.quantization.gguf import GGUFLinearMethod  # noqa: E402
from model_registry.layers.quantization.int8 import Int8LinearMethod  # noqa: E402
from model_registry.layers.quantization.prequant import PrequantLinearMethod  # noqa: E402
from model_registry.layers.quantization.quant_weight import ActQuant, QuantWeight, pack_int4  # noqa: E402
from model_registry.models.llama import LlamaDecoderLayer, LlamaModel  # noqa: E402
from vllite_core.attention.reference import build_metadata  # noqa: E402
from vllite_core.model_ops import ModelOps, use_model_ops  # noqa: E402

# As test_kernel_variants: every variant this CPU runs when installed, else the one the first-use build made.
RUNNABLE = kernels.host_variants() if kernels.origin() == "installed" else [kernels.variant()]
VARIANTS = [pytest.param(n, marks=pytest.mark.skipif(n not in RUNNABLE, reason=f"{n}: not runnable or not built here"))
            for n in NAMES]
BLOCK = 4
# Rows of one step: (query_len, seq_len) per request; decode rows (1) and prefill chunks mixed.
STEPS = {1: [(1, 7)], 3: [(1, 9), (2, 6)], 17: [(1, 5), (12, 12), (1, 3), (3, 10)],
         70: [(1, 5), (50, 50), (3, 10), (16, 20)]}  # 70: the bf16 gate_up fused with SiLU (from 64 rows)
CONFIGS = {
    "llama": LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, num_hidden_layers=1, vocab_size=32, rms_norm_eps=1e-5),
    "qwen2": Qwen2Config(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=1, vocab_size=32, rms_norm_eps=1e-6),
    "mistral": MistralConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=16, num_hidden_layers=1, vocab_size=32, sliding_window=8),
}
GGUF_TYPES = {"qkv_proj": "Q8_0", "o_proj": "Q4_0", "gate_up_proj": "Q4_1", "down_proj": "Q4_0"}


@pytest.fixture(params=VARIANTS)
def variant(request, monkeypatch):
    """kernels.load() returning one variant's module for the test."""
    kernels.load()
    monkeypatch.setattr(kernels, "_module", kernels.load_variant(request.param))
    return request.param


def platform_ops() -> CpuModelOps:
    """What CpuPlatform.model_ops builds on this host, for the chosen variant."""
    return CpuModelOps(fused=True, packed_linear=True, widen_16bit=not has_fast_bf16(), avx2_gemm=use_avx2_gemm(),
                       bf16_gemm=use_bf16_gemm(), int8_gemm=use_int8_gemm())


def make_layer(name: str, dtype: torch.dtype, quant: str, ops: ModelOps, seed: int = 0) -> LlamaDecoderLayer:
    cfg = CONFIGS[name]
    g = torch.Generator().manual_seed(seed)
    with use_model_ops(ops):
        layer = LlamaDecoderLayer(cfg, TorchPagedAttention(), dtype, None)
    randomize(layer, dtype, g)
    quantize(layer, quant)
    return layer


def quantize(layer: LlamaDecoderLayer, quant: str) -> None:
    """The layer's linears as GGUF blocks ("gguf"), int8 with a scale per row ("int8"), pre-quantized int4 or fp8
    weights ("w4a16", "fp8"), or as they are ("plain")."""
    linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    if quant == "gguf":
        to_gguf(layer)
    elif quant == "int8":
        for lin in linears:
            Int8LinearMethod.quantize(lin)
    elif quant in ("w4a16", "fp8"):
        for lin in linears:
            to_prequant(lin, quant)


def to_prequant(lin, quant: str, group: int = 32) -> None:
    """The linear's weight as a pre-quantized ``QuantWeight`` (symmetric int4 codes, zero 8, or e4m3 codes with fp8
    activations per token and group), scales per row and ``group`` columns, as a checkpoint's loader leaves it."""
    w = lin.weight.detach().float()
    n, k = w.shape
    g = w.view(n, k // group, group)
    if quant == "w4a16":
        scales = (g.abs().amax(-1) / 7).clamp_min(1e-8)
        codes = (torch.round(g / scales[..., None]).clamp(-8, 7) + 8).to(torch.uint8).view(n, k)
        qw = QuantWeight(pack_int4(codes), scales.contiguous(), None, 4, group, n, k, zero=8)
    else:
        scales = (g.abs().amax(-1) / 448).clamp_min(1e-8)
        codes = (g / scales[..., None]).to(torch.float8_e4m3fn).view(n, k).contiguous()
        qw = QuantWeight(codes, scales.contiguous(), None, 8, group, n, k, act=ActQuant("fp8", "group", None, group))
    method = PrequantLinearMethod(None, {})  # type: ignore[arg-type]  # the checkpoint's format: only for loading
    method.weight = qw
    lin.weight = torch.nn.Parameter(qw.codes, requires_grad=False)
    lin.set_quant_method(method)


def takes_native(ops: CpuModelOps, layer: LlamaDecoderLayer, quant: str, dtype: torch.dtype, rows: int) -> bool:
    """Whether this host's ops route the layer's linears to kernels the C++ call runs at this many rows."""
    qkv = layer.self_attn.qkv_proj.weight
    if quant == "int8":
        return ops.int8_route(dtype, qkv)
    return quant in ("gguf", "w4a16", "fp8") or ops.linear_route(dtype, rows, qkv) in ("small", "avx2", "bf16")


def randomize(module: torch.nn.Module, dtype: torch.dtype, g: torch.Generator) -> None:
    for p in module.parameters():
        p.data.copy_((torch.randn(p.shape, generator=g) * 0.2).to(dtype))
    for norm in module.modules():
        if isinstance(norm, RMSNorm):
            norm.weight.data.add_(1.0)


def to_gguf(layer: LlamaDecoderLayer) -> None:
    """The layer's linears as GGUF blocks (GGUF_TYPES), quantized from their weights by gguf-py."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from model_registry.layers.quantization.gguf import repack

    for lin_name, qtype in GGUF_TYPES.items():
        lin = getattr(layer.self_attn if lin_name in ("qkv_proj", "o_proj") else layer.mlp, lin_name)
        raw = quantize(lin.weight.float().numpy().astype(np.float32), GGMLQuantizationType[qtype])
        GGUFLinearMethod.use_blocks(lin, repack(raw, qtype))


def make_step(name: str, layer: LlamaDecoderLayer, rows: int, dtype: torch.dtype, seed: int = 1):
    """(rope, x, residual, kv_cache, metadata) of one step: random cached context, random blocks."""
    attn = layer.self_attn
    g = torch.Generator().manual_seed(seed)
    reqs = STEPS[rows]
    free = torch.randperm(64, generator=g)[:32].tolist()
    tables = [[free.pop() for _ in range(-(-s // BLOCK))] for _, s in reqs]
    md = build_metadata([q for q, _ in reqs], [s for _, s in reqs], tables, BLOCK)
    positions = torch.cat([torch.arange(s - q, s) for q, s in reqs])
    rope = RotaryEmbedding(CONFIGS[name], attn.head_size).lookup(positions, dtype)
    hidden = CONFIGS[name].hidden_size
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    residual = torch.randn(rows, hidden, generator=g).to(dtype)
    cache = torch.randn(2, 64, BLOCK, attn.num_kv_heads, attn.head_size, generator=g).to(dtype)
    return rope, x, residual, cache, md


def run(layer, step, native: bool, first: bool = False):
    """The layer on clones of the step's tensors (the layer writes x, residual and the cache in place)."""
    rope, x, residual, cache, md = step
    x, residual, cache = x.clone(), residual.clone(), cache.clone()
    md = dataclasses.replace(md, extra=None)  # the attention plan made afresh
    layer.self_attn.attn.backend.prepare(md)
    with torch.inference_mode():
        if native:
            out = layer._ops.decoder_layer(layer.fast_path_record())(rope, x, None if first else residual, cache, md)
            assert out is not None, "the C++ layer declined"
        else:
            layer._native = False
            out = layer.forward(rope, x, None if first else residual, cache, md)
    return out[0], out[1], cache


CASES = [("llama", torch.float32, "plain"), ("llama", torch.bfloat16, "plain"), ("llama", torch.float32, "gguf"),
         ("qwen2", torch.float32, "plain"), ("qwen2", torch.bfloat16, "gguf"), ("llama", torch.bfloat16, "int8"),
         ("qwen2", torch.float32, "int8"),
         # int4 x int8 (qwen2's down_proj, 96 inputs: the float int4 kernel), int4 float32, fp8 with fp8 activations
         ("llama", torch.bfloat16, "w4a16"), ("qwen2", torch.bfloat16, "w4a16"), ("qwen2", torch.float32, "w4a16"),
         ("llama", torch.bfloat16, "fp8"), ("qwen2", torch.float32, "fp8")]


@pytest.mark.parametrize("rows", sorted(STEPS))
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{str(c[1])[6:]}-{c[2]}")
def test_native_layer_is_the_python_path_bit_for_bit(variant, case, rows):
    name, dtype, quant = case
    ops = platform_ops()
    layer = make_layer(name, dtype, quant, ops)
    step = make_step(name, layer, rows, dtype)
    if not takes_native(ops, layer, quant, dtype, rows):  # oneDNN or _int_mm at this row count
        # None where oneDNN takes every row count (native bf16 math)
        native = layer._ops.decoder_layer(layer.fast_path_record())
        with torch.inference_mode():
            assert native is None or native(*step) is None
        return
    for first in (False, True):
        want = run(layer, step, native=False, first=first)
        got = run(layer, step, native=True, first=first)
        for a, b, what in zip(got, want, ("hidden states", "residual", "kv cache")):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a, b), f"{what} differ (first layer: {first})"


def test_plain_weight_kernel_and_its_limit(variant):
    """Without the AVX2 GEMM a few rows go to small_linear on the plain weight (the C++ side too); more rows
    go to oneDNN, which the C++ side does not call: the layer then runs its Python code."""
    ops = CpuModelOps(fused=True, packed_linear=True, widen_16bit=not has_fast_bf16(), avx2_gemm=False)
    layer = make_layer("llama", torch.float32, False, ops)
    step = make_step("llama", layer, 3, torch.float32)
    for a, b in zip(run(layer, step, native=True), run(layer, step, native=False)):
        assert torch.equal(a, b)
    rope, x, residual, cache, md = make_step("llama", layer, 17, torch.float32)
    layer.self_attn.attn.backend.prepare(md)
    with torch.inference_mode():
        assert layer._ops.decoder_layer(layer.fast_path_record())(rope, x, residual, cache, md) is None


def test_weight_change_repacks_the_shared_panels(variant):
    if not platform_ops().avx2_gemm:
        pytest.skip("no AVX2 GEMM in this variant")
    layer = make_layer("llama", torch.float32, False, platform_ops())
    step = make_step("llama", layer, 3, torch.float32)
    run(layer, step, native=True)
    qkv = layer.self_attn.qkv_proj
    packed = qkv.state["packed"]
    with torch.no_grad():
        qkv.weight.mul_(0.5)  # an in-place change: the version moves
    got = run(layer, step, native=True)
    assert qkv.state["packed"] is not packed  # repacked once, in the state the Python path reads
    packed = qkv.state["packed"]
    want = run(layer, step, native=False)
    assert qkv.state["packed"] is packed  # ... and shared with it, not packed again
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_declines_where_it_does_not_apply(variant):
    layer = make_layer("llama", torch.float32, False, platform_ops())
    native = layer._ops.decoder_layer(layer.fast_path_record())
    rope, x, residual, cache, md = make_step("llama", layer, 3, torch.float32)
    layer.self_attn.attn.backend.prepare(md)
    with torch.inference_mode():
        assert native(rope, x.clone(), residual.clone(), cache.clone(), md) is not None
        layer.mlp.down_proj.lora = object()  # an adapter slot, set at run time
        assert native(rope, x, residual, cache, md) is None
        layer.mlp.down_proj.lora = None
        fp8 = cache.to(torch.float8_e4m3fn)
        assert native(rope, x, residual, fp8, md) is None
    assert native(rope, x, residual, cache, md) is None  # grad mode
    with torch.inference_mode():
        Int8LinearMethod.quantize(layer.mlp.gate_up_proj)
        taken = native(rope, x.clone(), residual.clone(), cache.clone(), md) is not None
        assert taken == layer._ops.int8_gemm  # an int8 linear: the C++ call only with the int8 GEMM
    assert ModelOps().decoder_layer(layer.fast_path_record()) is None
    without = CpuModelOps(fused=True, packed_linear=True, widen_16bit=not has_fast_bf16(), avx2_gemm=use_avx2_gemm(),
                          bf16_gemm=use_bf16_gemm(), int8_gemm=False)
    layer = make_layer("llama", torch.float32, "int8", without)
    assert without.decoder_layer(layer.fast_path_record()) is None  # int8 on torch._int_mm: never the C++ call


def test_a_swapped_part_keeps_the_python_path(variant):
    """A model that swaps a part of the layer (the EAGLE head drops its input norm) runs the layer's own code."""
    layer = make_layer("llama", torch.float32, False, platform_ops())
    layer.input_layernorm = torch.nn.Identity()
    rope, x, _, cache, md = make_step("llama", layer, 3, torch.float32)
    layer.self_attn.attn.backend.prepare(md)
    with torch.inference_mode():
        out, residual = layer.forward(rope, x, None, cache, md)
    assert layer._native is False and residual is x and torch.isfinite(out).all()


# ---- all layers in one call (NativeDecoderStack, csrc/decoder.cpp's llama_decoder_stack) ----------------------------

def make_model(name: str, dtype: torch.dtype, quant: str, ops: ModelOps, layers: int = 3) -> LlamaModel:
    args = {k: v for k, v in CONFIGS[name].to_dict().items() if k != "layer_types"}  # made again for `layers`
    cfg = CONFIGS[name].__class__(**{**args, "num_hidden_layers": layers})
    with use_model_ops(ops):
        model = LlamaModel(cfg, TorchPagedAttention(), dtype)
    randomize(model, dtype, torch.Generator().manual_seed(0))
    for layer in model.layers:
        quantize(layer, quant)
    return model


def make_model_step(model: LlamaModel, rows: int, seed: int = 1, reqs: list[tuple[int, int]] | None = None,
                    blocks: int = 64):
    """(input ids, positions, per-layer caches, per-layer metadata) of one step (STEPS[rows], or `reqs` of that
    many rows; caches of `blocks` blocks, half of them free for each group). Layers 0 and 2 share one metadata
    object (one cache group), layer 1 has its own with other blocks (a second group)."""
    g = torch.Generator().manual_seed(seed)
    reqs = reqs or STEPS[rows]
    mds = []
    for _ in range(2):
        free = torch.randperm(blocks, generator=g)[:blocks // 2].tolist()
        tables = [[free.pop() for _ in range(-(-s // BLOCK))] for _, s in reqs]
        mds.append(build_metadata([q for q, _ in reqs], [s for _, s in reqs], tables, BLOCK))
    positions = torch.cat([torch.arange(s - q, s) for q, s in reqs])
    ids = torch.randint(0, model.embed_tokens.weight.shape[0], (rows,), generator=g)
    attn = model.layers[0].self_attn
    caches = [torch.randn(2, blocks, BLOCK, attn.num_kv_heads, attn.head_size, generator=g)
              .to(model.norm.weight.dtype) for _ in model.layers]
    return ids, positions, caches, [mds[0], mds[1], mds[0]][:len(model.layers)]


def run_model(model: LlamaModel, step, stack: bool, native=None) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """The model on clones of the step's caches, all layers in one call (stack: `native`, or one made for the
    call) or one by one; and how many one-call stacks ran."""
    ids, positions, caches, mds = step
    caches = [c.clone() for c in caches]
    fresh = {id(md): dataclasses.replace(md, extra=None) for md in mds}  # plans made afresh, sharing kept
    mds = [fresh[id(md)] for md in mds]
    for md in fresh.values():
        model.layers[0].self_attn.attn.backend.prepare(md)
    calls = []
    model._native_stack = False
    if stack:
        native = native or model._ops.decoder_stack(list(model.layers))
        assert native is not None
        fn = native.fn
        native.fn = lambda *args: calls.append(1) or fn(*args)
        model._native_stack = native
    with torch.inference_mode():
        out = model(ids, positions, caches, mds)
    if stack:
        native.fn = fn
    return out, caches, len(calls)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", sorted(STEPS))
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{str(c[1])[6:]}-{c[2]}")
def test_native_stack_is_the_layers_one_by_one_bit_for_bit(variant, case, rows, threads):
    """At 2 threads and up to 4 rows the threads run the whole call as one team (csrc/team.h): every linear
    split over them, nothing else, so the results must still be those of the per-layer calls."""
    name, dtype, quant = case
    ops = platform_ops()
    model = make_model(name, dtype, quant, ops)
    if not takes_native(ops, model.layers[0], quant, dtype, rows):
        return  # the layers decline here (test_native_layer_is_the_python_path_bit_for_bit)
    assert_stack_is_the_layers(model, make_model_step(model, rows), threads)


def assert_stack_is_the_layers(model: LlamaModel, step, threads: int) -> None:
    """The step through the one-call stack on `threads` threads gives the layers' outputs and caches bit for bit."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got, got_caches, calls = run_model(model, step, stack=True)
        want, want_caches, _ = run_model(model, step, stack=False)
    finally:
        torch.set_num_threads(before)
    assert calls == 1
    assert torch.equal(got, want), "hidden states differ"
    for i, (a, b) in enumerate(zip(got_caches, want_caches)):
        assert torch.equal(a, b), f"layer {i}'s cache differs"


@pytest.mark.parametrize("case", [("llama", torch.bfloat16, "plain"), ("qwen2", torch.float32, "plain")],
                         ids=lambda c: f"{c[0]}-{str(c[1])[6:]}")
def test_native_stack_team_splits_long_attention_bit_for_bit(variant, case):
    """A decode step of a few rows over a long context (query rows x positions x heads >= 32,768): inside the
    stack's team the attention's tasks split over the threads too (csrc/attention.cpp), and each row's result is
    the per-layer calls' (where attention ran under at::parallel_for)."""
    name, dtype, quant = case
    ops = platform_ops()
    model = make_model(name, dtype, quant, ops)
    if not takes_native(ops, model.layers[0], quant, dtype, 3):
        return
    assert_stack_is_the_layers(model, make_model_step(model, 3, reqs=[(1, 8300), (2, 8250)], blocks=8448), 2)


def test_split_step_cuts_at_requests_into_shares_of_equal_work(variant):
    """csrc/decoder.cpp's split_step: each share a run of whole requests, about equal work (query rows x 512 plus
    the context positions they attend to), padding rows in the last share, no split where it cannot be even."""
    split = kernels.load().decoder_split_step

    def ints(values):
        return torch.tensor(values, dtype=torch.int32)

    def starts(q_lens):
        return ints(np.cumsum([0, *q_lens]).tolist())

    assert split(starts([1, 1, 1, 1]), ints([9, 9, 9, 9]), 4, 4, 2) == [(0, 2, 0, 2), (2, 4, 2, 4)]
    assert split(starts([1, 1, 1, 1]), ints([9, 9, 9, 9]), 6, 4, 2) == [(0, 2, 0, 2), (2, 6, 2, 4)]  # 2 padding rows
    # a long context weighs as much as several short ones
    assert split(starts([1, 1, 1, 1, 1]), ints([2000, 10, 10, 10, 10]), 5, 5, 2) == [(0, 1, 0, 1), (1, 5, 1, 5)]
    assert split(starts([3, 1, 1, 2]), ints([10, 5, 900, 8]), 7, 7, 2) == [(0, 4, 0, 2), (4, 7, 2, 4)]
    assert split(starts([12, 1]), ints([12, 5]), 13, 13, 2) == []  # a prefill chunk beside a decode row: uneven
    assert split(starts([1]), ints([5]), 1, 1, 2) == []  # fewer requests than shares
    assert split(starts([1, 1, 1]), ints([9, 9, 9]), 3, 3, 3) == [(0, 1, 0, 1), (1, 2, 1, 2), (2, 3, 2, 3)]


# Requests of a step that split_step cuts in two (decode rows and prefill chunks on both sides).
SPLIT_REQS = [(1, 7), (1, 9), (2, 6), (1, 3), (1, 12), (3, 10), (1, 5), (1, 8)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{str(c[1])[6:]}-{c[2]}")
def test_native_stack_split_by_requests_is_the_layers_one_by_one_bit_for_bit(variant, case, monkeypatch):
    """From SPLIT_MIN_ROWS_PER_THREAD rows a thread, with every linear on the bf16 or int8 GEMM, each of 2 threads
    runs its share of the requests through every layer alone (csrc/decoder.cpp): hidden states and caches must be
    the per-layer calls' bit for bit. That the split ran shows in the residual stream it returns: concatenated from the
    shares, where the whole step's is the input tensor, updated in place. An error in a share's thread raises."""
    name, dtype, quant = case
    ops = platform_ops()
    model = make_model(name, dtype, quant, ops)
    rows = sum(q for q, _ in SPLIT_REQS)
    if not takes_native(ops, model.layers[0], quant, dtype, rows):
        return  # the layers decline here (test_native_layer_is_the_python_path_bit_for_bit)
    step = make_model_step(model, rows, reqs=SPLIT_REQS)
    native = model._ops.decoder_stack(list(model.layers))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.setattr(NativeDecoderStack, "SPLIT_MIN_ROWS_PER_THREAD", rows // 2)
        got, got_caches, calls = run_model(model, step, stack=True, native=native)
        want, want_caches, _ = run_model(model, step, stack=False)
        ids, positions, caches, mds = step

        def splits(stack: NativeDecoderStack) -> bool:
            fresh = {id(md): dataclasses.replace(md, extra=None) for md in mds}
            with torch.inference_mode():
                x = model.embed_tokens.weight[ids]
                _, residual = stack(model.rotary_emb.lookup(positions, x.dtype), x, [c.clone() for c in caches],
                                    [fresh[id(md)] for md in mds])
            return residual.data_ptr() != x.data_ptr()

        split = {}
        for min_rows in (rows // 2, rows // 2 + 1):  # the split, then the whole step
            monkeypatch.setattr(NativeDecoderStack, "SPLIT_MIN_ROWS_PER_THREAD", min_rows)
            split[min_rows] = splits(native)
        # GEMMs on AMX tiles and weights beyond the last-level cache: from SPLIT_MIN_ROWS_FROM_MEMORY_AMX rows only
        monkeypatch.setattr(NativeDecoderStack, "SPLIT_MIN_ROWS_PER_THREAD", rows // 2)
        monkeypatch.setattr(decoder_layer, "amx_gemms", lambda: True)
        monkeypatch.setattr(decoder_layer, "last_level_cache_bytes", lambda: 1 << 10)
        from_memory = {}
        for min_rows in (rows // 2 + 1, rows // 2):
            monkeypatch.setattr(NativeDecoderStack, "SPLIT_MIN_ROWS_FROM_MEMORY_AMX", min_rows)
            from_memory[min_rows] = splits(model._ops.decoder_stack(list(model.layers)))
        monkeypatch.setattr(decoder_layer, "last_level_cache_bytes", lambda: 1 << 40)  # the weights fit: rows // 2
        from_memory["cached"] = splits(model._ops.decoder_stack(list(model.layers)))
        # an error inside a share's thread is a RuntimeError here, and the next call works
        monkeypatch.setattr(NativeDecoderStack, "SPLIT_MIN_ROWS_PER_THREAD", rows // 2)
        bad = [c.clone() for c in caches]
        bad[2] = bad[2][:, :, :, :1]  # one KV head too few for layer 2's attention
        fresh = {id(md): dataclasses.replace(md, extra=None) for md in mds}
        mds = [fresh[id(md)] for md in mds]
        with torch.inference_mode():
            rope = model.rotary_emb.lookup(positions, dtype)
            with pytest.raises(RuntimeError):
                native(rope, model.embed_tokens.weight[ids], bad, mds)
            assert native(rope, model.embed_tokens.weight[ids], [c.clone() for c in caches], mds) is not None
    finally:
        torch.set_num_threads(before)
    assert calls == 1
    qkv = model.layers[0].self_attn.qkv_proj.weight
    gemms = quant == "int8" or (quant == "plain" and ops.linear_route(dtype, rows, qkv) == "bf16")
    assert split == {rows // 2: gemms, rows // 2 + 1: False}
    assert from_memory == {rows // 2 + 1: False, rows // 2: gemms, "cached": gemms}
    assert torch.equal(got, want), "hidden states differ"
    for i, (a, b) in enumerate(zip(got_caches, want_caches)):
        assert torch.equal(a, b), f"layer {i}'s cache differs"


@pytest.mark.parametrize("quant,dtype", [("plain", torch.float32), ("plain", torch.bfloat16), ("int8", torch.float32)])
def test_native_stack_keeps_its_specs_until_a_source_changes(variant, quant, dtype):
    """The stack reuses its layers' specs from step to step (no per-step Python check of each packed weight);
    an in-place change of a bias or an int8 scale that panels were made from is seen (layer_specs_current),
    those panels are made again, and the result is the layers' one by one."""
    ops = platform_ops()
    model = make_model("qwen2", dtype, quant, ops)  # qwen2: a bias on qkv_proj
    if not takes_native(ops, model.layers[0], quant, dtype, 17):
        pytest.skip("this variant's ops keep these linears off the C++ path")
    step = make_model_step(model, 17)
    native = model._ops.decoder_stack(list(model.layers))
    first, _, calls = run_model(model, step, stack=True, native=native)
    specs = native.made[False][0]
    again, _, calls2 = run_model(model, step, stack=True, native=native)
    assert calls == calls2 == 1 and native.made[False][0] is specs and torch.equal(again, first)
    with torch.no_grad():
        if quant == "int8":
            model.layers[1].mlp.down_proj.quant_method.weight_scale.mul_(0.5)
        else:
            model.layers[1].self_attn.qkv_proj.bias.mul_(0.5)
    got, got_caches, calls = run_model(model, step, stack=True, native=native)
    assert calls == 1 and native.made[False][0] is not specs
    want, want_caches, _ = run_model(model, step, stack=False)
    assert not torch.equal(got, first), "the change had no effect"
    assert torch.equal(got, want)
    for a, b in zip(got_caches, want_caches):
        assert torch.equal(a, b)
    specs = native.made[False][0]
    qkv = model.layers[2].self_attn.qkv_proj  # a bias swapped for a new object (the spec still holds the old one)
    qkv.bias = torch.nn.Parameter(qkv.bias.detach() * 2, requires_grad=False)
    got, _, calls = run_model(model, step, stack=True, native=native)
    assert calls == 1 and native.made[False][0] is not specs
    want, _, _ = run_model(model, step, stack=False)
    assert torch.equal(got, want)


def test_native_stack_declines_per_step_and_raises_cleanly(variant):
    """A step one layer does not take (a LoRA slot set at run time) runs the layers one by one; a bad argument
    inside the threads' team is a RuntimeError, after which the next call works."""
    ops = platform_ops()
    model = make_model("llama", torch.float32, True, ops)
    step = make_model_step(model, 1)
    _, _, calls = run_model(model, step, stack=True)
    assert calls == 1
    want, _, _ = run_model(model, step, stack=False)
    model.layers[1].mlp.down_proj.lora = lambda x, y: y  # an adapter slot that adds nothing
    out, _, calls = run_model(model, step, stack=True)
    assert calls == 0 and torch.equal(out, want)
    model.layers[1].mlp.down_proj.lora = None
    native = model._ops.decoder_stack(list(model.layers))
    ids, positions, caches, mds = step
    for md in mds:
        model.layers[0].self_attn.attn.backend.prepare(md)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            x = model.embed_tokens.weight[ids]
            rope = model.rotary_emb.lookup(positions, x.dtype)
            bad = [c.clone() for c in caches]
            bad[2] = bad[2][:, :, :, :1]  # one KV head too few for layer 2's attention
            with pytest.raises(RuntimeError):
                native(rope, x.clone(), bad, mds)
            assert native(rope, x.clone(), [c.clone() for c in caches], mds) is not None
    finally:
        torch.set_num_threads(before)


# ---- what the fast path reports -------------------------------------------------------------------------------

@pytest.mark.parametrize("quant", ["plain", "int8", "gguf"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_fast_path_takes_every_layer_of_the_llama_family(variant, name, quant, caplog):
    """Read from the typed records alone, every layer of a Llama-family model (Llama, Qwen2 with q/k/v bias; a
    Mistral window is an attention option) takes the C++ path wherever this host's ops put its linears on kernels
    the C++ side calls; the report says so per layer, and a layer it cannot take is named with its reason."""
    ops = platform_ops()
    dtype = torch.float32
    model = make_model(name, dtype, quant, ops)
    if not any(takes_native(ops, layer, quant, dtype, rows) for layer in model.layers[:1] for rows in (1, 17)):
        pytest.skip("this host's ops put the linears on oneDNN or _int_mm: no C++ path to take")
    report = report_fast_paths(model)
    assert report.paths == ("fused",) * 3 and report.describe(ops.name).endswith("3 of 3 decoder layers on the "
                                                                                 "platform's fused path")
    swapped = make_model(name, dtype, quant, ops)
    swapped.layers[1].input_layernorm = torch.nn.Identity()  # as the EAGLE head's layer
    with caplog.at_level("INFO", logger="vllite.platform.cpu"):
        assert report_fast_paths(swapped).paths == ("fused", "modules", "fused")
    assert "its norms are not both RMSNorm" in caplog.text or "its norms are not both RMSNorm" in decoder_layer_told()


def decoder_layer_told() -> str:
    """The reasons already logged in this process (each is logged once)."""
    from vllite_platform_cpu import decoder_layer

    return " ".join(decoder_layer._TOLD)


# Layers 1 and 3 attention, 0 and 2 Mamba; layer 3's feed-forward MoE: layer 1 alone is a Llama-style layer.
JAMBA = JambaConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=4,
                    expert_layer_offset=3, num_experts=2, num_experts_per_tok=1, mamba_d_state=8, mamba_d_conv=4,
                    mamba_expand=2)


def make_jamba(ops: ModelOps, dtype: torch.dtype = torch.float32):
    from model_registry.models.jamba import JambaForCausalLM

    with use_model_ops(ops):
        model = JambaForCausalLM(JAMBA, TorchPagedAttention(), dtype)
    randomize(model, dtype, torch.Generator().manual_seed(0))
    return model


def test_the_fast_path_takes_the_attention_layers_of_a_hybrid(variant, caplog):
    """Jamba's attention layers with a dense MLP (no RoPE: ``rope=None`` in the record) take the C++ path; its
    Mamba layers and its attention layer with an MoE feed-forward run their modules, each reason logged."""
    ops = platform_ops()
    model = make_jamba(ops)
    if not any(takes_native(ops, model.model.layers[1], "plain", torch.float32, rows) for rows in (1, 17)):
        pytest.skip("this host's ops put the linears on oneDNN: no C++ path to take")
    with caplog.at_level("INFO", logger="vllite.platform.cpu"):
        report = report_fast_paths(model)
    assert report.paths == ("modules", "fused", "modules", "modules")
    told = caplog.text + decoder_layer_told()
    assert "a Mamba mixer layer" in told and "an MoE feed-forward" in told


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", sorted(STEPS))
def test_hybrid_attention_layer_native_is_its_modules_bit_for_bit(variant, rows, dtype):
    """Jamba's ``x + attn(norm(x))`` then ``+ mlp(norm(.))`` is the C++ layer's ``out + residual`` on identity
    rotary tables: hidden states and the paged cache it writes equal the modules' bit for bit; the step's
    embeddings (read again by other hybrids) are left as they were."""
    ops = platform_ops()
    layer = make_jamba(ops, dtype).model.layers[1]
    if not takes_native(ops, layer, "plain", dtype, rows):
        pytest.skip("this host's ops put the linears on oneDNN at this row count")
    attn = layer.self_attn
    g = torch.Generator().manual_seed(1)
    reqs = STEPS[rows]
    free = torch.randperm(64, generator=g)[:32].tolist()
    tables = [[free.pop() for _ in range(-(-s // BLOCK))] for _, s in reqs]
    md = build_metadata([q for q, _ in reqs], [s for _, s in reqs], tables, BLOCK)
    x = torch.randn(rows, JAMBA.hidden_size, generator=g).to(dtype)
    cache = torch.randn(2, 64, BLOCK, attn.num_kv_heads, attn.head_size, generator=g).to(dtype)

    def run(native: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
        calls: list[int] = []
        layer._native = None if native else False
        if native:
            fast = layer.native_layer()
            assert fast is not None
            call = fast.fn
            fast.fn = lambda *args: calls.append(1) or call(*args)
        step_md = dataclasses.replace(md, extra=None)
        attn.attn.backend.prepare(step_md)
        c, embeddings = cache.clone(), x.clone()
        with torch.inference_mode():
            out = layer(embeddings, [c], [step_md], HybridStep(None, embeddings))
        assert torch.equal(embeddings, x)
        return out, c, len(calls)

    got, got_cache, calls = run(native=True)
    want, want_cache, _ = run(native=False)
    assert calls == 1, "the C++ layer declined"
    assert torch.equal(got, want), "hidden states differ"
    assert torch.equal(got_cache, want_cache), "kv cache differs"
