"""Compile the kernels for a GPU target without a GPU (Triton lowers to PTX/cubin or AMDGCN/hsaco on the host).

Proves the kernels type-check and lower for a device that is not here, e.g.::

    python -m vllite_triton_kernels.aot cuda:90 hip:gfx942

Not under TRITON_INTERPRET=1 (interpreted kernels do not compile).
"""
from __future__ import annotations

import json
import sys
from typing import Any

_TORCH_TO_TRITON = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float8_e4m3fn": "fp8e4nv",
                    "float8_e5m2": "fp8e5", "float8_e4m3fnuz": "fp8e4b8", "float8_e5m2fnuz": "fp8e5b16"}


def target(spec: str) -> Any:
    """'cuda:90' (compute capability 9.0), 'hip:gfx942' -> a Triton GPUTarget."""
    from triton.backends.compiler import GPUTarget

    backend, arch = spec.split(":", 1)
    if backend == "cuda":
        return GPUTarget("cuda", int(arch), 32)
    if backend == "hip":
        return GPUTarget("hip", arch, 64)
    raise ValueError(f"unknown target {spec!r} (cuda:CC or hip:gfxNNN)")


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, (n - 1).bit_length()))


def compile_attention(spec: str, dtype: str = "float16", cache_dtype: str | None = None, num_heads: int = 32,
                      num_kv_heads: int = 8, head_size: int = 128, block_size: int = 16, sliding_window: int = 0,
                      tile_n: int = 64, soft_cap: float = 0.0) -> dict[str, Any]:
    """Compile ``paged_attention_kernel`` as ``TritonPagedAttention`` would launch it; returns facts."""
    import triton
    from triton.compiler import ASTSource

    from vllite_triton_kernels import kernels

    fn = kernels.paged_attention_kernel
    dt, ct = _TORCH_TO_TRITON[dtype], _TORCH_TO_TRITON[cache_dtype or dtype]
    qpk = num_heads // num_kv_heads
    block_m = _pow2(qpk, 16)
    const = dict(QUERIES_PER_KV=qpk, HEAD_SIZE=head_size, HEAD_P=_pow2(head_size, 16), BLOCK_SIZE=block_size,
                 BLOCK_Q=block_m // qpk, BLOCK_M=block_m, TILE_N=tile_n, SLIDING_WINDOW=sliding_window,
                 IEEE=dtype == "float32", SOFT_CAP=soft_cap)
    ptrs = {"out_ptr": dt, "q_ptr": dt, "k_cache_ptr": ct, "v_cache_ptr": ct, "block_table_ptr": "i32",
            "seq_lens_ptr": "i32", "query_start_loc_ptr": "i32"}
    sig = {}
    for name in fn.arg_names:
        if name in ptrs:
            sig[name] = "*" + ptrs[name]
        elif name in const:
            sig[name] = "constexpr"
        else:
            sig[name] = "fp32" if name.endswith("scale") else "i32"
    compiled = triton.compile(ASTSource(fn, sig, constexprs=const), target=target(spec))
    return {"target": spec, "kernel": fn.__name__, "binary": [k for k in compiled.asm if k in ("cubin", "hsaco")],
            "shared_bytes": int(getattr(compiled.metadata, "shared", 0)), "num_warps": compiled.metadata.num_warps}


def compile_store(spec: str, dtype: str = "float16", cache_dtype: str | None = None, num_kv_heads: int = 8,
                  head_size: int = 128, block_size: int = 16) -> dict[str, Any]:
    import torch
    import triton
    from triton.compiler import ASTSource

    from vllite_triton_kernels import kernels

    fn = kernels.store_kv_kernel
    dt, ct = _TORCH_TO_TRITON[dtype], _TORCH_TO_TRITON[cache_dtype or dtype]
    fp8_max = float(torch.finfo(getattr(torch, cache_dtype)).max) if cache_dtype and "float8" in cache_dtype else 0.0
    const = dict(NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size, HD_P=_pow2(num_kv_heads * head_size),
                 BLOCK_SIZE=block_size, BLOCK_T=16, FP8_MAX=fp8_max)
    ptrs = {"key_ptr": dt, "value_ptr": dt, "k_cache_ptr": ct, "v_cache_ptr": ct, "slot_ptr": "i64"}
    sig = {n: ("*" + ptrs[n]) if n in ptrs else ("constexpr" if n in const else
                                                  "fp32" if n.endswith("scale") else "i32") for n in fn.arg_names}
    compiled = triton.compile(ASTSource(fn, sig, constexprs=const), target=target(spec))
    return {"target": spec, "kernel": fn.__name__, "binary": [k for k in compiled.asm if k in ("cubin", "hsaco")]}


def compile_pointwise(spec: str, dtype: str = "bfloat16", hidden: int = 576, head_size: int = 64,
                      heads: int = 9) -> list[dict[str, Any]]:
    """Compile ``pointwise_kernels``' three kernels as ``TritonModelOps`` launches them; returns facts per kernel."""
    import triton
    from triton.compiler import ASTSource

    from vllite_triton_kernels import pointwise_kernels as pk

    dt = "*" + _TORCH_TO_TRITON[dtype]
    launches = [
        (pk.rms_norm_kernel, dict(HAS_RESIDUAL=True, BLOCK=_pow2(hidden, 16)), {"eps": "fp32"}),
        (pk.silu_and_mul_kernel, dict(BLOCK=min(1024, _pow2(hidden, 16))), {}),
        (pk.rotary_kernel, dict(HALF=head_size // 2, BLOCK_H=_pow2(heads)), {}),
    ]
    out = []
    for fn, const, scalars in launches:
        sig = {n: "constexpr" if n in const else scalars.get(n, dt if n.endswith("_ptr") else "i32")
               for n in fn.arg_names}
        compiled = triton.compile(ASTSource(fn, sig, constexprs=const), target=target(spec))
        out.append({"target": spec, "kernel": fn.__name__,
                    "binary": [k for k in compiled.asm if k in ("cubin", "hsaco")]})
    return out


def main(argv: list[str]) -> int:
    specs = argv or ["cuda:80", "cuda:90", "hip:gfx942"]
    ok = True
    for spec in specs:
        for dtype in ("float16", "bfloat16", "float32"):
            try:
                print(json.dumps(compile_attention(spec, dtype)))
            except Exception as exc:  # report every failure, then fail
                ok = False
                print(json.dumps({"target": spec, "dtype": dtype, "error": str(exc).splitlines()[-1][:300]}))
        print(json.dumps(compile_store(spec)))
        for facts in compile_pointwise(spec):
            print(json.dumps(facts))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
