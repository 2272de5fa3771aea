"""The shared Triton kernels compile for real GPUs that are not here: Triton lowers them on the host to
cubin (NVIDIA sm_80 / sm_90) and hsaco (AMD MI300, gfx942). And Triton's own refusal of e4m3 fp8 on sm_80
agrees with the CUDA platform's capability rule.

In a subprocess: the interpreter tests in this session decorate the kernels for TRITON_INTERPRET=1,
which cannot be compiled."""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys

import pytest
from plugin_fakes import PLATFORM_SRC

# Not importorskip: importing triton here, before the interpreter tests set TRITON_INTERPRET, would break them.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (pip install -r requirements-test.txt)")

SCRIPT = """
import json
from vllite_triton_kernels.aot import compile_attention, compile_pointwise, compile_store
out = []
def attempt(fn, *a, **k):
    try:
        out.append(fn(*a, **k))
    except Exception as exc:
        out.append({"target": a[0], "error": str(exc).splitlines()[-1][:300], **k})
attempt(compile_attention, "cuda:90", "float16", num_heads=32, num_kv_heads=8, head_size=128)
attempt(compile_attention, "cuda:80", "float32", num_heads=8, num_kv_heads=8, head_size=64, sliding_window=256)
attempt(compile_attention, "hip:gfx942", "bfloat16", cache_dtype="float8_e4m3fnuz", num_heads=64, num_kv_heads=8)
attempt(compile_attention, "cuda:80", "float16", cache_dtype="float8_e4m3fn", num_heads=8, num_kv_heads=8)
attempt(compile_store, "cuda:90", "bfloat16", cache_dtype="float8_e5m2")
for spec in ("cuda:90", "hip:gfx942"):
    try:
        out.extend(compile_pointwise(spec))
    except Exception as exc:
        out.append({"target": spec, "error": str(exc).splitlines()[-1][:300]})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_DEFAULT_FP_FUSION="1", TRITON_CACHE_DIR=os.environ.get("TRITON_CACHE_DIR", "/tmp/vllite-triton"))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_compiles_for_hopper_ampere_and_mi300(compiled):
    h100, a100_fp32_window, mi300_fp8 = compiled[:3]
    assert h100.get("binary") == ["cubin"], h100
    assert a100_fp32_window.get("binary") == ["cubin"], a100_fp32_window
    assert mi300_fp8.get("binary") == ["hsaco"], mi300_fp8
    assert 0 < h100["shared_bytes"] <= 100 * 1024  # fits any sm_80+ SM's shared memory
    assert compiled[4].get("binary") == ["cubin"], compiled[4]


def test_pointwise_kernels_compile_for_hopper_and_mi300(compiled):
    pointwise = compiled[5:]
    assert [(c.get("target"), c.get("kernel"), c.get("binary")) for c in pointwise] == [
        (spec, kernel, [binary]) for spec, binary in (("cuda:90", "cubin"), ("hip:gfx942", "hsaco"))
        for kernel in ("rms_norm_kernel", "silu_and_mul_kernel", "rotary_kernel")], pointwise


def test_e4m3_refused_on_ampere_like_the_platform_rule(compiled):
    refused = compiled[3]
    assert "error" in refused and "fp8e4nv not supported" in refused["error"], refused
    if str(PLATFORM_SRC["cuda"]) not in sys.path:
        sys.path.append(str(PLATFORM_SRC["cuda"]))
    rules = importlib.import_module("vllite_platform_cuda.platform")
    assert "fp8_e4m3" not in rules.kv_cache_dtypes_for_capability((8, 0))
    assert "fp8_e4m3" in rules.kv_cache_dtypes_for_capability((9, 0))
