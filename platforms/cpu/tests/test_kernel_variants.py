"""Every ISA variant of the CPU kernels that this CPU runs, against torch references.

The engine takes the highest variant (``kernels.load()``); these tests force each one
(``kernels.load_variant``), so an AVX-512 host also checks its ``avx2`` and ``default`` builds, and check
how the variant is chosen (``VLLITE_CPU_ISA``), the first-use build's key, and that no variant's
instructions leaked into code the others share. The platform's own tests: ``pytest platforms/cpu/tests``
(``-m "not slow"`` leaves out the first-use build, minutes of compiling).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from vllite_platform_cpu import isa, kernels

if not kernels.available():
    pytest.skip(f"CPU kernels not built here: {kernels.error()}", allow_module_level=True)

# From the installed module every variant the CPU runs is at hand; a first-use build makes one per
# variant (a minute each), so then only the one load() chose is tested.
RUNNABLE = kernels.host_variants() if kernels.origin() == "installed" else [kernels.variant()]
VARIANTS = [pytest.param(n, marks=pytest.mark.skipif(n not in RUNNABLE, reason=f"{n}: not runnable or not built here"))
            for n in isa.NAMES]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def close(a, b, dtype, tol32=2e-6, tol16=1e-2):
    tol = tol32 if dtype == torch.float32 else tol16
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


def ref_rms(x, w, eps):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


@pytest.fixture
def fresh(monkeypatch):
    """kernels.py as before its first load(), restored afterwards."""
    for name, value in (("_tried", False), ("_module", None), ("_error", None), ("_variant", None),
                        ("_origin", None), ("_variant_modules", {})):
        monkeypatch.setattr(kernels, name, value)
    return kernels


@pytest.mark.parametrize("name", VARIANTS)
def test_variant_module(name):
    mod = kernels.load_variant(name)
    assert mod.name == name
    # The AVX2 GEMM is in every variant compiled with AVX2 and FMA.
    assert bool(mod.avx2_gemm_available()) == (name != "default")
    assert list(mod.avx2_gemm_dtypes()) == ([] if name == "default" else ["float32", "bfloat16", "float16"])


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_and_fused_residual(name, dtype, rows):
    mod = kernels.load_variant(name)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g).to(dtype)
    r = torch.randn(rows, 576, generator=g).to(dtype)
    w = torch.randn(576, generator=g).to(dtype)
    out = torch.empty_like(x)
    mod.rms_norm(out, x, w, 1e-5)
    close(out, ref_rms(x, w, 1e-5), dtype)
    h, res = x.clone(), r.clone()
    mod.add_rms_norm(h, res, w, 1e-5)
    assert torch.equal(res, r + x)  # the residual add rounds exactly like torch's
    close(h, ref_rms(r + x, w, 1e-5), dtype)


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 1536), (64, 1536), (64, 1539)])
def test_silu_and_mul(name, dtype, rows, n):
    mod = kernels.load_variant(name)
    x = torch.randn(rows, 2 * n, generator=torch.Generator().manual_seed(1)).to(dtype) * 4
    gate, up = x.chunk(2, dim=-1)
    out = x.new_empty(rows, n)
    mod.silu_and_mul(out, x)
    want = F.silu(gate) * up
    # Whole vectors: torch's silu bit for bit (float32 and float16: the same vectorised SLEEF exp; bfloat16: ATen's
    # exp_u20, whose error never reaches a bfloat16 rounding here), the same rounding. Not so ATen's DEFAULT vectors
    # (std::exp), nor a row's last partial vector (torch: scalar std::exp).
    if name == "default" or n % 16:
        close(out, want, dtype, tol32=1e-5)
    else:
        assert torch.equal(out, want)


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128, 96])  # whole-vector heads (4 or 8 vectors) and the scalar loop
def test_rotary_in_place_on_strided_views(name, dtype, d):
    mod = kernels.load_variant(name)
    t, h, hkv = 37, 9, 3
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=g).to(dtype)
    cos, sin = torch.randn(t, d, generator=g).to(dtype), torch.randn(t, d, generator=g).to(dtype)
    q, k, _ = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    q, k = q.view(t, h, d), k.view(t, hkv, d)

    def neox(x):
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return x * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]

    want_q, want_k = neox(q), neox(k)
    v_before = qkv[:, (h + hkv) * d:].clone()
    mod.rotary(q, k, cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)  # no contraction, torch's roundings: exact everywhere
    assert torch.equal(qkv[:, (h + hkv) * d:], v_before)


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("wdtype", DTYPES)
@pytest.mark.parametrize("m,k,n", [(1, 576, 1536), (3, 576, 49), (4, 100, 7)])
def test_small_linear(name, wdtype, m, k, n):
    mod = kernels.load_variant(name)
    g = torch.Generator().manual_seed(m * n)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g).to(wdtype), torch.randn(n, generator=g)
    out = torch.empty(m, n)
    mod.small_linear(out, x, w, b)
    torch.testing.assert_close(out, F.linear(x, w.float(), b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_add(name, dtype):
    """Multi-LoRA: rows grouped by slot in ``order``, each slot its own rank (one not adapting the layer),
    rows outside every segment untouched; against float64 per-row math on the same (rounded) tensors."""
    mod = kernels.load_variant(name)
    g = torch.Generator().manual_seed(7)
    t, d_in, d_out, cap = 23, 77, 45, 12  # not multiples of any vector width
    x, y = torch.randn(t, d_in, generator=g).to(dtype), torch.randn(t, d_out, generator=g).to(dtype)
    a = torch.randn(3, cap, d_in, generator=g).to(dtype)
    b = (torch.randn(3, cap, d_out, generator=g) * 0.3).to(dtype)
    ranks = [12, 0, 5]
    segments = {2: [3, 0, 17, 9, 22, 5], 0: [1, 2, 4, 8, 11, 12, 13, 20, 21], 1: [6, 7]}
    order = torch.tensor([r for s in sorted(segments) for r in segments[s]])
    starts = [0, 9, 11, 17]
    want = y.double().clone()
    for s, rows in segments.items():
        r = ranks[s]
        for row in rows:
            want[row] += (x[row].double() @ a[s, :r].double().T) @ b[s, :r].double()
    got = y.clone()
    mod.lora_add(got, x, a, b, order, [0, 1, 2], starts, ranks)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())
    untouched = [r for r in range(t) if r not in segments[0] + segments[2]]
    assert torch.equal(got[untouched], y[untouched])


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("wdtype", DTYPES)
@pytest.mark.parametrize("m,k,n", [(1, 576, 1536), (5, 576, 49), (64, 100, 7), (200, 64, 33)])
def test_avx2_gemm(name, wdtype, m, k, n):
    # float32, bfloat16 and float16 panels (16-bit ones widened as read), against float32 math on the widened weight
    mod = kernels.load_variant(name)
    if not mod.avx2_gemm_available():
        pytest.skip(f"{name}: no AVX2 GEMM")
    g = torch.Generator().manual_seed(m + n)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g).to(wdtype), torch.randn(n, generator=g)
    packed = mod.avx2_gemm_pack(w)
    assert packed.dtype == wdtype
    out = torch.empty(m, n)
    mod.avx2_gemm(out, x, packed, b)
    torch.testing.assert_close(out, F.linear(x, w.float(), b), rtol=1e-4, atol=1e-4)


def _paged_case(head_size, heads, kv_heads, q_lens, s_lens, dtype, block=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    nb = sum(-(-s // block) for s in s_lens) + 2
    kc = torch.randn(nb, block, kv_heads, head_size, generator=g).to(dtype)
    vc = torch.randn(nb, block, kv_heads, head_size, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), heads, head_size, generator=g).to(dtype)
    perm = torch.randperm(nb, generator=g).int()  # blocks scattered through the cache
    table = torch.zeros(len(s_lens), max(-(-s // block) for s in s_lens), dtype=torch.int32)
    used = 0
    for i, s in enumerate(s_lens):
        count = -(-s // block)
        table[i, :count] = perm[used:used + count]
        used += count
    seq = torch.tensor(s_lens, dtype=torch.int32)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, kc, vc, table, seq, starts


def _ref_paged(q, kc, vc, table, seq, starts, scale, window):
    """Causal attention of each request's query rows (the last of its context) in float32."""
    heads, d = q.shape[1:]
    block, kv_heads = kc.shape[1], kc.shape[2]
    out = torch.empty(q.shape, dtype=torch.float32)
    for r in range(len(seq)):
        L, q0, q1 = int(seq[r]), int(starts[r]), int(starts[r + 1])
        blocks = table[r, :-(-L // block)].long()
        k = kc[blocks].reshape(-1, kv_heads, d)[:L].float().repeat_interleave(heads // kv_heads, dim=1)
        v = vc[blocks].reshape(-1, kv_heads, d)[:L].float().repeat_interleave(heads // kv_heads, dim=1)
        qpos = torch.arange(L - (q1 - q0), L)
        kpos = torch.arange(L)
        mask = kpos[None, :] <= qpos[:, None]
        if window:
            mask &= kpos[None, :] > qpos[:, None] - window
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), k) * scale
        p = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", p, v)
    return out


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size,heads,kv_heads,q_lens,s_lens,window", [
    (64, 9, 3, [1, 1, 1, 17], [200, 40, 513, 300], 0),  # decode rows (streaming path) and a prefill tile
    (128, 8, 2, [1, 20], [300, 20], 0),
    (80, 4, 2, [3, 20], [200, 20], 0),  # head size off the vector paths
    (64, 9, 3, [1, 17], [200, 40], 30),  # sliding window
    (64, 9, 3, [1] * 40, [100] * 40, 0),  # many tiles: all KV heads per task
    # rows >= kFlashMinRows (256): ATen's flash attention, a whole prompt (causal) and a chunk after 344 cached
    # positions (two calls merged by log-sum-exp) beside a decode row and a short prefill on run's tiles; a chunk
    # after more positions than it has rows; with a window: run's
    (64, 8, 2, [1, 300, 256, 20], [900, 300, 600, 40], 0),
    (128, 8, 2, [260], [260], 0),
    (128, 8, 2, [270], [1100], 0),
    (64, 9, 3, [300], [500], 64),
])
def test_paged_attention(name, dtype, head_size, heads, kv_heads, q_lens, s_lens, window):
    mod = kernels.load_variant(name)
    q, kc, vc, table, seq, starts = _paged_case(head_size, heads, kv_heads, q_lens, s_lens, dtype)
    out = torch.empty_like(q)
    mod.paged_attention(out, q, kc, vc, table, seq, starts, torch.arange(len(s_lens), dtype=torch.int32), 0.125,
                        window, 1.0, 1.0, 0.0)  # k_scale, v_scale (float8 caches), soft_cap (0: none)
    ref = _ref_paged(q, kc, vc, table, seq, starts, 0.125, window)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_store(name, dtype):
    """The fused store writes each row's key/value at its slot (a -1 slot and rows past the slots nowhere), as
    index_copy_ would, then attends over the cache as paged_attention does."""
    mod = kernels.load_variant(name)
    q_lens, s_lens = [1, 1, 5], [40, 17, 21]
    q, kc, vc, table, seq, starts = _paged_case(64, 9, 3, q_lens, s_lens, dtype)
    g = torch.Generator().manual_seed(1)
    t = q.shape[0] + 1  # one padding row past the slots
    qkv = torch.randn(t, 15, 64, generator=g).to(dtype)  # k and v as strided views of a fused projection
    k, v = qkv[:, 9:12], qkv[:, 12:]
    slots = []
    for r in range(len(s_lens)):
        for pos in range(s_lens[r] - q_lens[r], s_lens[r]):
            blk = int(table[r, pos // 16])
            slots.append(blk * 16 + pos % 16)
    slots[3] = -1  # a padded row inside the step
    slots = torch.tensor(slots, dtype=torch.int64)
    kv = torch.stack([kc, vc])
    ref = kv.clone()
    keep = slots >= 0
    ref[0].view(-1, 3, 64).index_copy_(0, slots[keep], k[:len(slots)][keep])
    ref[1].view(-1, 3, 64).index_copy_(0, slots[keep], v[:len(slots)][keep])
    out = torch.empty(t, 9, 64, dtype=dtype)
    rid = torch.arange(len(s_lens), dtype=torch.int32)
    qp = torch.cat([q, q[:1]])
    mod.paged_attention_store(out, qp, k, v, kv, slots, table, seq, starts, rid, 0.125, 0, 0.0)
    assert torch.equal(kv, ref)
    expect = torch.empty_like(qp)
    mod.paged_attention(expect, qp, ref[0], ref[1], table, seq, starts, rid, 0.125, 0, 1.0, 1.0, 0.0)
    assert torch.equal(out[:q.shape[0]], expect[:q.shape[0]])


def test_load_takes_the_highest_runnable_variant(fresh, monkeypatch):
    monkeypatch.delenv(kernels.ISA_ENV, raising=False)
    assert fresh.load() is not None
    assert fresh.variant() == fresh.host_variants()[-1]
    assert fresh.variant() != "avx512_bf16" or "avx512_bf16" in fresh.host_features()


@pytest.mark.parametrize("cap", isa.NAMES)
def test_isa_env_caps_the_variant(fresh, monkeypatch, cap):
    monkeypatch.setenv(kernels.ISA_ENV, cap)
    want = [n for n in fresh.host_variants() if isa.rank(n) <= isa.rank(cap)][-1]
    assert fresh.load() is not None and fresh.variant() == want
    assert fresh.load().name == want


def test_isa_env_unknown_value_is_ignored(fresh, monkeypatch):
    monkeypatch.setenv(kernels.ISA_ENV, "sse9")
    assert fresh.variant() == fresh.host_variants()[-1]


def test_kernel_env_still_turns_the_kernels_off(fresh, monkeypatch):
    monkeypatch.setenv(kernels.KERNEL_ENV, "0")
    assert not fresh.available()
    assert fresh.error() == f"disabled by {kernels.KERNEL_ENV}=0"


def test_load_variant_refuses_what_the_cpu_lacks(fresh, monkeypatch):
    monkeypatch.setattr(fresh, "host_features", lambda: set())
    assert fresh.load_variant("default").name == "default"
    with pytest.raises(ValueError, match="lacks avx2"):
        fresh.load_variant("avx2")
    with pytest.raises(ValueError, match="unknown CPU kernel variant"):
        fresh.load_variant("avx1024")


def test_variant_table():
    assert [v.name for v in isa.X86_VARIANTS] == list(isa.NAMES)
    for lower, higher in zip(isa.X86_VARIANTS, isa.X86_VARIANTS[1:]):  # each needs what the ones below need
        assert set(lower.requires) <= set(higher.requires)
    assert all("-march=native" not in f for v in isa.X86_VARIANTS for f in isa.variant_flags(v))
    assert [v.name for v in isa.variants("aarch64")] == ["default"]


def test_sources_ship_in_the_package():
    files = set(os.listdir(kernels.csrc_dir()))
    assert {isa.BINDINGS_SOURCE, *isa.KERNEL_SOURCES, "common.h", "kernels.h"} <= files


def test_installed_module_is_used_only_when_built_from_these_sources(monkeypatch, tmp_path):
    """The installed module carries the digest of the C++ files it was built from; a module built from other
    sources (an edited kernel, an editable install not rebuilt) is set aside for the first-use build."""
    mod, why = kernels._installed()
    if mod is None:
        pytest.skip(f"no installed module: {why}")
    assert mod.sources_digest == isa.sources_digest(kernels.csrc_dir())
    copy = shutil.copytree(kernels.csrc_dir(), tmp_path / "csrc")
    with open(copy / "team.h", "a") as f:
        f.write("// an edit\n")
    assert isa.sources_digest(str(copy)) != mod.sources_digest
    monkeypatch.setattr(kernels, "csrc_dir", lambda: str(copy))
    monkeypatch.setattr(kernels, "_installed_state", None)
    mod2, why2 = kernels._installed()
    assert mod2 is None and "other sources" in why2


def test_first_use_build_is_keyed_by_the_environment(monkeypatch, tmp_path):
    v = isa.get("default")
    here = kernels._build_name(v)
    assert here == kernels._build_name(v) and here.startswith("vllite_cpu_default_")
    assert kernels._build_name(isa.get("avx2")) != here
    # Another checkout with equal sources (a git worktree) gets its own folder: torch's build file names the
    # sources by path, so a shared folder would be rewritten and recompiled on every start from either one.
    copy = shutil.copytree(kernels.csrc_dir(), tmp_path / "csrc")
    monkeypatch.setattr(kernels, "csrc_dir", lambda: str(copy))
    unedited = kernels._build_name(v)
    assert unedited != here
    with open(copy / "amx.h", "a") as f:  # an edit of any header makes another build
        f.write("// an edit\n")
    assert kernels._build_name(v) != unedited
    monkeypatch.undo()
    monkeypatch.setattr(sys, "prefix", sys.prefix + "-another-venv")
    assert kernels._build_name(v) != here


def test_first_use_build_removes_a_killed_builds_lock(monkeypatch, tmp_path):
    """torch's build ``lock`` left by a killed build would make this build wait forever: it is removed;
    a build in progress elsewhere holds the OS lock, so only a dead one's file is ever removed."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("VLLITE_CACHE_ROOT", str(tmp_path))
    build_dir = tmp_path / "torch_extensions" / kernels._build_name(isa.get("default"))
    build_dir.mkdir(parents=True)
    (build_dir / "lock").touch()
    seen = []

    def fake_load(**kw):
        seen.append((build_dir / "lock").exists())
        return type("Mod", (), {"default": "the variant"})

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    assert kernels._jit_build("default") == "the variant"
    assert seen == [False]


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump")
def test_no_variant_instructions_in_shared_code():
    """The linked module keeps one copy of each inline function several variants emit (the standard
    library's, c10's): it must be one without AVX registers, or the default variant could run AVX2 or
    AVX-512 code on a CPU without them. (Local clones, e.g. ``.constprop``, stay with their variant.)"""
    mod, why = kernels._installed()
    if mod is None:
        pytest.skip(f"no installed module: {why}")
    so = mod.__file__
    nm = subprocess.run(["nm", "-C", "--defined-only", so], capture_output=True, text=True, check=True).stdout
    shared = {line[19:] for line in nm.splitlines() if line[17:18] in ("T", "W", "V", "u", "i")}
    dis = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", so], capture_output=True, text=True,
                         check=True).stdout
    variant_code = re.compile(r"vllite_cpu::isa_(avx2|avx512|avx512_bf16)::|at::vec::AVX2::|at::vec::AVX512::")
    leaks, fn = {}, None
    for line in dis.splitlines():
        m = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if m:
            fn = m.group(1)
        elif fn in shared and not variant_code.search(fn) and re.search(r"%[yz]mm\d", line):
            leaks.setdefault(fn, line.strip())
    assert not leaks, leaks


def _wait_for_the_build_ahead(folder: str) -> None:
    """conftest.py started the build when this test was collected: wait until it is done (or has died)."""
    done = os.path.join(folder, "built")
    with open(os.path.join(folder, "pid")) as f:
        pid = int(f.read())
    while not os.path.exists(done):
        try:
            with open(f"/proc/{pid}/stat") as f:
                running = f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            running = False
        if not running and not os.path.exists(done):
            with open(os.path.join(folder, "build.log")) as f:
                pytest.fail(f"the first-use build (pid {pid}) ended without a result:\n{f.read()[-3000:]}")
        time.sleep(2)
    with open(done) as f:
        result = f.read()
    assert result.startswith("jit default"), result


@pytest.mark.slow
def test_first_use_build_matches_the_installed_variant(fresh, monkeypatch, first_use_build_dir):
    """Without the installed module, load() compiles the chosen variant from the package's sources, with
    the same flags: the same results, bit for bit. The compiling (minutes) was started in the background as
    this test was collected (conftest.py), by the same load() in a process of its own; here load() finds that
    build complete and only loads it."""
    installed, _ = kernels._installed()
    if installed is None:
        pytest.skip("no installed module to compare with")
    folder = first_use_build_dir
    _wait_for_the_build_ahead(folder)
    monkeypatch.setattr(fresh, "_installed_state", (None, "ImportError: hidden by the test"))
    monkeypatch.setenv("VLLITE_CACHE_ROOT", folder)
    monkeypatch.setenv(kernels.ISA_ENV, "default")
    jit = fresh.load()
    assert jit is not None and fresh.origin() == "jit" and fresh.variant() == "default", fresh.error()
    assert os.listdir(os.path.join(folder, "torch_extensions"))[0].startswith("vllite_cpu_default_")
    q, kc, vc, table, seq, starts = _paged_case(64, 9, 3, [1, 1, 17], [200, 40, 300], torch.bfloat16)
    rid = torch.arange(3, dtype=torch.int32)
    outs = []
    for mod in (jit, installed.default):
        out = torch.empty_like(q)
        mod.paged_attention(out, q, kc, vc, table, seq, starts, rid, 0.125, 0, 1.0, 1.0, 0.0)
        x = torch.randn(5, 2 * 576, generator=torch.Generator().manual_seed(3))
        s = x.new_empty(5, 576)
        mod.silu_and_mul(s, x)
        outs.append((out, s))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
