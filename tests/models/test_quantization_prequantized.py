"""Pre-quantized checkpoints (model_registry.layers.quantization.prequantized): each fixture under
tests/fixtures/prequant/ was written once by its format's own producer (make_compressed_tensors.py:
llm-compressor 0.14 / compressed-tensors 0.19; make_gptq_awq.py: auto-round 0.15) with reference.json holding
what transformers 5.17 computed on it (greedy tokens and their logprobs, float32). vllite loads the folder with
no ``quantization`` argument and must produce the same tokens; logprobs agree to float32 rounding where the
arithmetic is the same, and within a stated tolerance where it is not (int8 W8A8 with dynamic activations runs
on the int8 kernels, whose activation scale is amax/127 against compressed-tensors' amax/127.5)."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from vllite_core.config import ConfigError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "prequant"
# fixture -> (max |logprob - reference| over the tokens of the prompts that match, the least number of the 4
# prompts whose 8 tokens must all match). Every prompt's first token's logprob (the reference's token, from the
# top 20) is within the same tolerance.
CASES = {
    "w4a16_g32": (1e-4, 4),
    "w4a16_asym_g32": (1e-4, 4),
    "w8a16_g32": (1e-4, 4),
    "w4a16_gptq_actorder_weight_g32": (1e-4, 4),
    "w8a8_int8_static": (1e-4, 4),
    "w8a8_int8_dynamic": (0.15, 2),  # measured: 2 of 4 prompts, first-token logprobs within 0.1
    "fp8_dynamic": (0.05, 4),  # measured up to 0.023 (an fp8 activation rounded the other way)
    "fp8_static": (1e-2, 4),
    "fp8_block": (1e-3, 4),
    "gptq_w4_g32": (1e-4, 4),
    "gptq_w4_g32_sym": (1e-4, 4),
    "gptq_w8_g32": (1e-4, 4),
    "awq_w4_g32": (1e-4, 4),
}


FAST = ("w4a16_g32", "w8a8_int8_dynamic", "fp8_block", "gptq_w4_g32", "awq_w4_g32")  # the rest: slow


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    from model_registry.source import load_tokenizer, resolve_model_source

    d = tmp_path_factory.mktemp("tokenizer")
    load_tokenizer(resolve_model_source(None)).save_pretrained(d)
    return d


def _folder(tmp_path_factory, tokenizer_dir: Path, name: str, edit=None) -> str:
    """The fixture with a tokenizer beside it (the fixtures hold weights and config only)."""
    d = tmp_path_factory.mktemp(name)
    shutil.copytree(FIXTURES / name, d, dirs_exist_ok=True)
    shutil.copytree(tokenizer_dir, d, dirs_exist_ok=True)
    if edit is not None:
        cfg = json.loads((d / "config.json").read_text())
        edit(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in CASES])
def test_prequantized_matches_producer_reference(name, tmp_path_factory, tokenizer_dir):
    from vllite_core import LLM, SamplingParams

    tol, need = CASES[name]
    ref = json.loads((FIXTURES / name / "reference.json").read_text())["outputs"]
    llm = LLM(model=_folder(tmp_path_factory, tokenizer_dir, name), dtype="float32", num_threads=1)
    model = llm.llm_engine.core.engine_core.worker.runner.model
    layer = model.model.layers[0].self_attn.qkv_proj
    assert layer.quant_method.name in ("prequantized", "int8")
    assert layer.weight.dtype in (torch.uint8, torch.int8, torch.float8_e4m3fn)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=20)
    outs = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in ref], sp)
    same = 0
    for r, o in zip(ref, outs):
        first = o.outputs[0].logprobs[0]
        assert r["token_ids"][0] in first, name
        assert abs(first[r["token_ids"][0]].logprob - r["logprobs"][0]) < tol, (name, r)
        got = list(o.outputs[0].token_ids)
        if got != r["token_ids"]:
            continue
        same += 1
        lps = [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, got)]
        assert max(abs(a - b) for a, b in zip(lps, r["logprobs"])) < tol, (name, lps, r["logprobs"])
    assert same >= need, name


def test_quantization_argument_checked_against_checkpoint(tmp_path_factory, tokenizer_dir):
    from vllite_core import LLM

    folder = _folder(tmp_path_factory, tokenizer_dir, "w4a16_g32")
    with pytest.raises(ConfigError, match="does not match the checkpoint's quantization_config"):
        LLM(model=folder, dtype="float32", num_threads=1, quantization="int8")
    with pytest.raises(ConfigError, match="does not match"):
        LLM(model=folder, dtype="float32", num_threads=1, quantization="gptq")
    llm = LLM(model=folder, dtype="float32", num_threads=1, quantization="compressed-tensors")  # the same: fine
    assert llm.llm_engine.core.engine_core.worker.runner.model.model.layers[0].mlp.down_proj.weight.dtype == torch.uint8


def test_prequantized_method_needs_such_a_checkpoint():
    from transformers import LlamaConfig

    from model_registry.layers.quantization.prequantized import resolve_quantization

    plain = LlamaConfig()
    with pytest.raises(ConfigError, match="has no quantization_config"):
        resolve_quantization(plain, "awq")
    assert resolve_quantization(plain, "int8") == "int8" and resolve_quantization(plain, None) is None
    fp8 = LlamaConfig(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    assert resolve_quantization(fp8, None) == "fp8" and resolve_quantization(fp8, "fp8") == "fp8"
    with pytest.raises(ConfigError, match="'int8' does not match"):
        resolve_quantization(fp8, "int8")


def _scheme(cfg, **weights):
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"].update(weights)


@pytest.mark.parametrize("edit, match", [
    (lambda c: c["quantization_config"].update(quant_method="bitsandbytes"), "'bitsandbytes' checkpoints are not"),
    (lambda c: _scheme(c, num_bits=3), "unsupported compressed-tensors scheme .*int 3-bit group"),
    (lambda c: c["quantization_config"]["config_groups"]["group_0"].update(format="nvfp4-pack-quantized"),
     "unsupported compressed-tensors scheme .*nvfp4-pack-quantized"),
    (lambda c: _scheme(c, group_size=48), "weight_scale.*scale has shape|groups of 48"),
    (lambda c: c["quantization_config"].update(sparsity_config={"format": "sparse-24"}), "sparse"),
])
def test_bad_prequantized_configs_are_config_errors(tmp_path_factory, tokenizer_dir, edit, match):
    from vllite_core import LLM

    folder = _folder(tmp_path_factory, tokenizer_dir, "w4a16_g32", edit)
    with pytest.raises(ConfigError, match=match):
        LLM(model=folder, dtype="float32", num_threads=1)


def test_missing_scale_tensor_is_named(tmp_path_factory, tokenizer_dir):
    from safetensors.torch import load_file, save_file

    from vllite_core import LLM

    folder = Path(_folder(tmp_path_factory, tokenizer_dir, "w4a16_g32"))
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight_scale"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight_scale"):
        LLM(model=str(folder), dtype="float32", num_threads=1)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc/self/maps")
@pytest.mark.parametrize("name", ["fp8_block", "w8a8_int8_dynamic"])
def test_loaded_model_does_not_keep_the_checkpoint_mapped(name, tmp_path_factory, tokenizer_dir):
    """Layers whose codes are the checkpoint's bytes as stored (fp8, int8) own a copy once loaded: safetensors
    hands out views of the file's mapping, and a kept view kept the whole file mapped and resident (the process's
    RSS then counted the file on top of the weights' copies)."""
    from vllite_core import LLM, SamplingParams

    folder = _folder(tmp_path_factory, tokenizer_dir, name)
    llm = LLM(model=folder, dtype="float32", num_threads=1)
    weights = str(Path(folder) / "model.safetensors")
    assert not [line for line in Path("/proc/self/maps").read_text().splitlines() if line.endswith(weights)]
    out = llm.generate([{"prompt_token_ids": [3, 40, 9]}], SamplingParams(temperature=0, max_tokens=2))
    assert len(out[0].outputs[0].token_ids) == 2


FP8_BLOCK = 32  # the fixture's block (Qwen3-FP8 and DeepSeek-V3 use 128x128; the tiny model is 64 wide)


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """A tiny Llama saved in the ``quant_method: "fp8"`` layout of Qwen3-FP8 / DeepSeek-V3 (float8_e4m3fn weights,
    ``weight_scale_inv`` per 32x32 block, dynamic activations), written here as those checkpoints are (the
    block's amax / 448); and transformers' own reading of it (it dequantises fp8 checkpoints on CPU)."""
    from safetensors.torch import load_file, save_file
    from tiny_models import TINY, save_tiny
    from transformers import AutoModelForCausalLM, LlamaConfig

    d = tmp_path_factory.mktemp("fp8")
    save_tiny(d, LlamaConfig(**TINY))
    out = {}
    for k, v in load_file(d / "model.safetensors").items():
        if k.endswith("proj.weight"):
            n, kk = v.shape
            blocks = v.reshape(n // FP8_BLOCK, FP8_BLOCK, kk // FP8_BLOCK, FP8_BLOCK)
            s = blocks.abs().amax(dim=(1, 3)) / 448
            out[k] = (blocks / s[:, None, :, None]).to(torch.float8_e4m3fn).reshape(n, kk)
            out[k + "_scale_inv"] = s.float()
        else:
            out[k] = v
    save_file(out, d / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                  "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    (d / "config.json").write_text(json.dumps(cfg))
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for prompt in ([3, 40, 9, 100, 77], [5, 61, 200, 18], [300, 11, 12, 13, 14, 15]):
            ids = torch.tensor([prompt])
            tokens, lps = [], []
            for _ in range(6):
                lp = torch.log_softmax(hf(ids).logits[0, -1].float(), -1)
                t = int(lp.argmax())
                tokens.append(t)
                lps.append(float(lp[t]))
                ids = torch.cat([ids, torch.tensor([[t]])], dim=1)
            rows.append((prompt, tokens, lps))
    q_proj = hf.model.layers[1].self_attn.q_proj.weight.detach().clone()
    return str(d), rows, q_proj


def test_fp8_block_checkpoint_against_transformers(fp8_checkpoint, monkeypatch):
    """The weights vllite computes from are transformers' dequantisation bit for bit (every layer). transformers
    runs them on float activations, vllite quantizes the activations to fp8 per token and 32-column group (as the
    block-scaled models run, and as the compressed-tensors FP8 block fixture's producer computes them: that test
    holds the arithmetic); on this random model e4m3's 3 mantissa bits move the logits, so only the first token's
    logprob of transformers' choice is held, within 0.25."""
    from vllite_platform_cpu import kernels

    from vllite_core import LLM, SamplingParams

    calls = []
    fp8 = kernels.fp8_linear_act
    monkeypatch.setattr(kernels, "fp8_linear_act", lambda *a: calls.append(1) or fp8(*a))
    folder, rows, q_proj = fp8_checkpoint
    llm = LLM(model=folder, dtype="float32", num_threads=1)
    model = llm.llm_engine.core.engine_core.worker.runner.model
    layer = model.model.layers[1].self_attn.qkv_proj
    w = layer.quant_method.weight
    assert w.codes.dtype == torch.float8_e4m3fn and w.act.strategy == "group" and w.act.group == FP8_BLOCK
    assert torch.equal(w.dequantize()[:q_proj.shape[0]], q_proj)
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=20)
    outs = llm.generate([{"prompt_token_ids": p} for p, _, _ in rows], sp)
    for (_, tokens, lps), o in zip(rows, outs):
        first = o.outputs[0].logprobs[0]
        assert tokens[0] in first and abs(first[tokens[0]].logprob - lps[0]) < 0.25  # measured up to 0.11
    # the CPU platform's fp8 kernel computed them (through the Python layers, or in the one-call C++ layers)
    assert calls or native_kinds(model) == {6} or not kernels.available()


def native_kinds(model) -> set[int] | None:
    """The linear kinds (csrc/decoder.cpp) of the model's one-call C++ decoder layers at one row, None where a layer
    runs its Python code: the pre-quantized kernels then run inside that call, not through ``kernels``' wrappers."""
    kinds = set()
    for layer in model.model.layers:
        native = layer.native_layer()
        route = native.routes[True] if native is not None else None
        if route is None:
            return None
        kinds.update(route[0])
    return kinds


def _pack_gptq_columns(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [K, N] -> int32 [K * bits / 32, N] as GPTQ's qweight stores it (code k at bits * (k % per))."""
    per = 32 // bits
    k, n = codes.shape
    words = codes.to(torch.int64).reshape(k // per, per, n) << (torch.arange(per) * bits)[None, :, None]
    v = words.sum(dim=1)
    return torch.where(v >= 1 << 31, v - (1 << 32), v).to(torch.int32)


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_desc_act_layer_against_formula(bits):
    """GPTQ with desc_act: a g_idx that scatters the groups over the columns. The layer (repacked with its columns
    sorted by group) computes x @ W.T with W[n, k] = (q[n, k] - (qzeros[g_idx[k], n] + 1)) * scales[g_idx[k], n],
    GPTQ's documented v1 formula, evaluated here column by column in float64."""
    from model_registry.layers import ReplicatedLinear
    from model_registry.layers.quantization.gptq import GPTQFormat
    from model_registry.layers.quantization.prequant import PrequantLinearMethod

    g = torch.Generator().manual_seed(bits)
    n, k, group = 24, 64, 16
    groups = k // group
    codes = torch.randint(0, 2 ** bits, (k, n), generator=g)
    zeros = torch.randint(0, 2 ** bits - 1, (groups, n), generator=g)  # stored minus one
    scales = (torch.rand(groups, n, generator=g) * 0.1 + 0.01).half()
    g_idx = torch.arange(k) // group
    g_idx = g_idx[torch.randperm(k, generator=g)].to(torch.int32)  # desc_act: groups in another column order
    parts = {"qweight": _pack_gptq_columns(codes, bits), "qzeros": _pack_gptq_columns(zeros.T, bits).T.contiguous(),
             "scales": scales, "g_idx": g_idx}
    lin = ReplicatedLinear(k, n, bias=True, dtype=torch.float32)
    method = PrequantLinearMethod(GPTQFormat(bits, group), {None: "proj"}, "proj")
    method.create_weights(lin)
    for suffix, t in parts.items():  # the last one repacks the layer
        getattr(lin, suffix).weight_loader(None, t, None, f"proj.{suffix}")
    lin.bias.data.copy_(torch.randn(n, generator=g))
    assert method.done and method.weight is not None and method.weight.perm is not None and method.weight.group == group
    gi = g_idx.long()
    w = (codes.double().T - (zeros.double().T[:, gi] + 1)) * scales.double().T[:, gi]
    x = torch.randn(5, k, generator=g)
    want = x.double() @ w.T + lin.bias.double()
    torch.testing.assert_close(lin(x).double(), want, rtol=1e-5, atol=1e-4)


def _int4_weight(n: int, k: int, group: int, asym: bool, seed: int):
    from model_registry.layers.quantization.quant_weight import QuantWeight, pack_int4

    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, k // group, generator=g) * 0.05 + 0.01
    zeros = torch.randint(0, 16, (n, k // group), generator=g).float() if asym else None
    w = QuantWeight(pack_int4(codes), scales, zeros, 4, group, n, k, 8)
    z = zeros if asym else torch.full_like(scales, 8.0)
    idx = torch.arange(k) // group
    dense = (codes.double() - z.double()[:, idx]) * scales.double()[:, idx]
    return w, dense


@pytest.mark.parametrize("m, n, k, group", [(1, 2048 // 8, 512, 128), (3, 37, 96, 32), (7, 24, 40, 8),
                                            (1, 5, 32, 32), (17, 64, 256, 64)])
@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_int4_linear_against_float64(m, n, k, group, asym, dtype):
    """The CPU platform's int4 weight-only GEMM (csrc/wna16.cpp) against x @ W.T in float64 on the dequantised
    weight, remainders included (K not a multiple of 16, odd row counts); the torch reference too."""
    from vllite_platform_cpu import kernels
    from vllite_platform_cpu.model_ops import CpuModelOps

    from vllite_core.model_ops import ModelOps

    w, dense = _int4_weight(n, k, group, asym, m * n + k)
    g = torch.Generator().manual_seed(k)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    want = x.double() @ dense.T + bias.double()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    ops = [ModelOps()] + ([CpuModelOps(fused=True, packed_linear=False)] if kernels.available() else [])
    with torch.inference_mode():
        for op in ops:
            got = op.quant_linear(x, w, bias, {})
            assert got.dtype == dtype and got.shape == (m, n)
            torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * float(want.abs().max()))


@pytest.mark.parametrize("m, n, k, group, asym", [(1, 5, 64, 32, True), (5, 37, 192, 96, True),
                                                  (3, 24, 256, 64, False), (8, 2048, 2048, 128, True),
                                                  (1, 512, 2048, 128, False), (2, 9, 384, 32, True),
                                                  (5, 17, 384, 96, False), (3, 11, 512, 256, True)])
def test_cpu_int4_int8_linear_against_float64(m, n, k, group, asym):
    """csrc/wna16.cpp's int4 x int8 kernel (activations quantized per row, amax / 127), every variant this CPU
    runs: against the float64 product of its own quantized activations (float32 sums: 1e-5 of the magnitudes),
    and against x @ W.T in float64 within the int8 rounding's bound (each activation moves by at most half its
    row's step, so an output by at most step / 2 * sum |W[n, :]|); tile remainders (5 rows: 4 + 1), groups of
    32 and 96 (a scale per half block of 64 columns), a zero row, the 1B model's shapes; inner sizes that are
    multiples of 128 take the AVX512-VNNI tiles where the variant has them (groups of 32, 96: a scale per four
    lanes; 256: two blocks per group), the others the AVX2 ones."""
    from vllite_platform_cpu import kernels

    if not kernels.available():
        pytest.skip(f"no CPU kernels ({kernels.error()})")
    w, dense = _int4_weight(n, k, group, asym, m * n + k)
    g = torch.Generator().manual_seed(k + 1)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4
    if m > 1:
        x[1] = 0.0
    amax = x.abs().amax(dim=1, keepdim=True)
    step = amax / 127
    q = torch.round(x * torch.where(amax > 0, 127 / amax, 0.0)).double() * step.double()
    same = q @ dense.T
    exact = x.double() @ dense.T
    bound = 0.5 * step.double() * dense.abs().sum(1)[None, :]
    mag = q.abs() @ dense.abs().T
    for v in kernels.host_variants():
        out = torch.empty(m, n)
        kernels.load_variant(v).int4_linear_q8(out, x, w.codes, w.scales, w.zeros, w.zero, group)
        got = out.double()
        assert ((got - same).abs() <= 1e-5 * mag + 1e-6).all(), (v, float((got - same).abs().max()))
        assert ((got - exact).abs() <= bound + 1e-5 * mag + 1e-6).all(), v
        if m > 1:
            assert (got[1] == 0).all()


def _fp8_weight(n: int, k: int, group: int, seed: int):
    """A float8 e4m3 ``QuantWeight`` [n, k] (random codes plus both signs' subnormals, zeros and +-448) with
    ``ceil(k / group)`` scales per row (a per-tensor scale: every row's the same), and its float64 values."""
    from model_registry.layers.quantization.quant_weight import QuantWeight

    g = torch.Generator().manual_seed(seed)
    codes = (torch.randn(n, k, generator=g) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
    special = torch.tensor([0x00, 0x01, 0x07, 0x80, 0x81, 0x87, 0x7E, 0xFE], dtype=torch.uint8)
    codes.view(torch.uint8)[0, : min(k, 8)] = special[: min(k, 8)]
    scales = torch.rand(n, -(-k // group), generator=g) * 0.01 + 1e-4
    if group == k and n > 1:
        scales[:] = scales[0, 0]
    dense = codes.double() * scales.double()[:, torch.arange(k) // group]
    return QuantWeight(codes, scales, None, 8, group, n, k), dense


@pytest.mark.parametrize("variant", ["default", "avx2", "avx512", "avx512_bf16"])
def test_cpu_fp8_linear_against_float64(variant):
    """csrc/fp8_linear.cpp (e4m3 codes widened in registers, scales per group) against x @ W.T in float64 on the
    weight's exact values, within float32 summation (1e-5 of sum |x| |W|, per row): rows 1, 2, 5, 32 (tiles of 4
    and their remainders); 128-column block scales with N and K not multiples of 128 (a partial last group), per
    channel, per tensor, groups of 48 (not on 32-column blocks: the plain loop); K not a multiple of 32 (the tail
    of a group); subnormal and largest codes of both signs; rows scaled by 1e-38 .. 1e30 and a half-zero row (the
    kernel scales each row by a power of two)."""
    from vllite_platform_cpu import kernels

    if not kernels.available() or variant not in kernels.host_variants():
        pytest.skip(f"{variant} does not run here ({kernels.error() or 'CPU features'})")
    mod = kernels.load_variant(variant)
    for m, n, k, group in [(1, 200, 300, 128), (1, 38, 257, 128), (2, 37, 257, 128), (5, 130, 2048, 128),
                           (32, 100, 700, 700), (1, 2048 // 4, 2048, 2048), (3, 9, 17, 17), (2, 40, 200, 48),
                           (6, 20, 256, 128)]:
        w, dense = _fp8_weight(n, k, group, m * n + k)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
        if m == 6:
            x *= torch.tensor([1e-38, 1e-30, 1e-10, 1e10, 1e30, 1.0])[:, None]
            x[5, : k // 2] = 0
        out = torch.empty(m, n)
        mod.fp8_linear(out, x, w.codes, w.scales, group)
        want = x.double() @ dense.T
        mag = x.double().abs() @ dense.abs().T
        assert ((out.double() - want).abs() <= 1e-5 * mag).all(), (m, n, k, group)


@pytest.mark.parametrize("variant", ["default", "avx2", "avx512", "avx512_bf16"])
def test_cpu_fp8_linear_act_rounds_as_fake_quant(variant):
    """fp8_linear_act's activation rounding (fp8 per token, per token and group, static) is ``fake_quant``'s bit for
    bit: its product equals fp8_linear's on fake_quant's activations exactly; rows 1 (4-column tiles and a remainder)
    and 5, a zero row, values past the static scale's range (clamped to +-448), tiny values (e4m3 subnormals)."""
    from vllite_platform_cpu import kernels

    from model_registry.layers.quantization.quant_weight import ActQuant, fake_quant

    if not kernels.available() or variant not in kernels.host_variants():
        pytest.skip(f"{variant} does not run here ({kernels.error() or 'CPU features'})")
    mod = kernels.load_variant(variant)
    w, _ = _fp8_weight(38, 256, 128, 11)
    for m in (1, 5):
        x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)) * 3
        x[0, :7] = torch.tensor([1e-6, -3e-5, 1e-3, 500.0, -2000.0, 0.0, 4e-3])
        if m > 1:
            x[1] = 0
        for mode, act in ((1, ActQuant("fp8", "token")), (2, ActQuant("fp8", "group", None, 64)),
                          (3, ActQuant("fp8", "tensor", torch.tensor(0.5)))):
            want, got = torch.empty(m, 38), torch.empty(m, 38)
            mod.fp8_linear(want, fake_quant(x, act).contiguous(), w.codes, w.scales, 128)
            mod.fp8_linear_act(got, x, w.codes, w.scales, 128, mode, act.group or 0, 0.5 if mode == 3 else 0.0)
            assert torch.equal(got, want), (m, mode)


@pytest.mark.parametrize("act", [None, ("token", None), ("group", 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_fp8_quant_linear_against_reference(act, dtype, monkeypatch):
    """The CPU platform's ``quant_linear`` on float8 weights takes the fp8 kernel and computes the reference's
    arithmetic (activations fp8-quantized per token or per 128-column group first, as the checkpoint says),
    against float64 on the same quantized activations, bias and bf16 in / out included."""
    from vllite_platform_cpu import kernels
    from vllite_platform_cpu.model_ops import CpuModelOps

    from model_registry.layers.quantization.quant_weight import ActQuant, fake_quant

    if not kernels.available():
        pytest.skip(f"no CPU kernels ({kernels.error()})")
    calls = []
    fp8 = kernels.fp8_linear_act
    monkeypatch.setattr(kernels, "fp8_linear_act", lambda *a: calls.append(1) or fp8(*a))
    base, dense = _fp8_weight(70, 384, 128, 7)
    w = base if act is None else dataclasses.replace(base, act=ActQuant("fp8", act[0], None, act[1]))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 384, generator=g).to(dtype)
    bias = torch.randn(70, generator=g).to(dtype)
    h = x.float() if act is None else fake_quant(x.float(), w.act)
    want = h.double() @ dense.T + bias.double()
    with torch.inference_mode():
        got = CpuModelOps(fused=True, packed_linear=False).quant_linear(x, w, bias, {})
    assert calls and got.dtype == dtype and got.shape == (5, 70)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * float(want.abs().max()))


def test_w4a16_bf16_model_runs_int8_activations(tmp_path_factory, tokenizer_dir, monkeypatch):
    """A bf16 model with the llm-compressor W4A16 checkpoint runs its int4 linears on int8 activations
    (``int4_linear_q8``) and stays near the producer's float32 reference: measured, 3 of 4 prompts' 8 greedy tokens
    identical (the same 3 as with the float kernel in bf16: the 4th diverges at its 5th token on bf16 rounding
    either way), first-token logprobs within 0.081 (0.050 with float activations in bf16)."""
    from vllite_platform_cpu import kernels

    from vllite_core import LLM, SamplingParams

    if not kernels.available():
        pytest.skip(f"no CPU kernels ({kernels.error()})")
    calls = []
    q8 = kernels.int4_linear_q8
    monkeypatch.setattr(kernels, "int4_linear_q8", lambda *a: calls.append(1) or q8(*a))
    name = "w4a16_g32"
    ref = json.loads((FIXTURES / name / "reference.json").read_text())["outputs"]
    llm = LLM(model=_folder(tmp_path_factory, tokenizer_dir, name), dtype="bfloat16", num_threads=1)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=20)
    outs = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in ref], sp)
    assert calls or 5 in (native_kinds(llm.llm_engine.core.engine_core.worker.runner.model) or ())
    same = 0
    for r, o in zip(ref, outs):
        first = o.outputs[0].logprobs[0]
        assert r["token_ids"][0] in first and abs(first[r["token_ids"][0]].logprob - r["logprobs"][0]) < 0.15
        same += list(o.outputs[0].token_ids) == r["token_ids"]
    assert same >= 3
