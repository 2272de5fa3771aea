"""The ISA variants of the CPU kernels: the flags each is compiled with and the CPU features it needs.

One table for both builds: ``setup.py`` (which loads this file by path, without importing the package or
torch) compiles every variant of the host's architecture into the installed extension, and
``kernels.py`` picks the best one the CPU runs (and builds just that one on first use when the
extension is not installed). Lowest first; each needs the features of those before it.

Like ATen's own dispatch (``CPU_CAPABILITY`` DEFAULT / AVX2 / AVX512), the defines choose ATen's
``at::vec::Vectorized`` implementation per variant; ``avx512_bf16`` adds the AVX512-BF16 dot products of
the attention kernel and the bf16 GEMM (``__AVX512BF16__``) and the int8 GEMM's AVX512-VNNI ones.
``-march=native`` is never used: a build made on one CPU runs on any other of its architecture.
"""
from __future__ import annotations

import hashlib
import os
import platform
from typing import NamedTuple


class Variant(NamedTuple):
    name: str
    flags: tuple[str, ...]  # compiler flags beyond the common ones (gcc/clang spelling)
    requires: tuple[str, ...]  # CPU features, spelled as in /proc/cpuinfo

    @property
    def namespace(self) -> str:
        """The C++ namespace of the variant's functions (csrc/kernels.h)."""
        return "isa_" + self.name


_AVX2_FLAGS = ("-mavx2", "-mfma", "-mf16c", "-mbmi", "-mbmi2")
_AVX2_NEEDS = ("avx2", "fma", "f16c", "bmi1", "bmi2")
_AVX512_FLAGS = _AVX2_FLAGS + ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
_AVX512_NEEDS = _AVX2_NEEDS + ("avx512f", "avx512bw", "avx512vl", "avx512dq")

X86_VARIANTS = (
    Variant("default", ("-DCPU_CAPABILITY=DEFAULT",), ()),
    Variant("avx2", ("-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2") + _AVX2_FLAGS, _AVX2_NEEDS),
    Variant("avx512", ("-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512") + _AVX512_FLAGS, _AVX512_NEEDS),
    # Every CPU with AVX512-BF16 (Cooper Lake, Sapphire Rapids and later, Zen 4 and later) has AVX512-VNNI too.
    Variant("avx512_bf16", ("-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512") + _AVX512_FLAGS
            + ("-mavx512bf16", "-mavx512vnni"), _AVX512_NEEDS + ("avx512_bf16", "avx512_vnni")),
)
# Other architectures: the baseline only (ATen's DEFAULT vectors; the compiler's own auto-vectorisation).
OTHER_VARIANTS = (Variant("default", ("-DCPU_CAPABILITY=DEFAULT",), ()),)

NAMES = tuple(v.name for v in X86_VARIANTS)
# Every variant: the translation units compiled with its flags (csrc/), and the common flags. -fopenmp:
# at::parallel_for is OpenMP inline code (without it every kernel ran on one thread); libgomp resolves to
# the copy torch already loaded (same soname).
KERNEL_SOURCES = ("attention.cpp", "gemm.cpp", "amx.cpp", "pointwise.cpp", "quant.cpp", "gguf.cpp", "wna16.cpp",
                  "fp8_linear.cpp", "encoder.cpp", "lora.cpp", "moe.cpp", "decoder.cpp")
BINDINGS_SOURCE = "bindings.cpp"
COMMON_FLAGS = ("-O3", "-fopenmp", "-DNDEBUG")
LINK_FLAGS = ("-fopenmp",)


def sources_digest(csrc: str) -> str:
    """What a build is made from: every C++ file in ``csrc`` (.cpp and .h), by name and content. setup.py compiles
    it into the installed module and kernels.py compares it with the shipped files', so a module built from other
    sources (an editable install not rebuilt since a kernel changed) is never used; the first-use build is keyed by
    it."""
    h = hashlib.sha256()
    for name in sorted(f for f in os.listdir(csrc) if f.endswith((".cpp", ".h"))):
        with open(os.path.join(csrc, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read() + b"\0")
    return "d" + h.hexdigest()[:16]  # a C identifier: setup.py passes it as a macro's value


def is_x86(machine: str | None = None) -> bool:
    m = (machine or platform.machine()).lower()
    return m in ("x86_64", "amd64", "i386", "i686", "x86")


def variants(machine: str | None = None) -> tuple[Variant, ...]:
    """The variants built for an architecture (default: this one), lowest first."""
    return X86_VARIANTS if is_x86(machine) else OTHER_VARIANTS


def get(name: str) -> Variant:
    for v in X86_VARIANTS:
        if v.name == name:
            return v
    raise ValueError(f"unknown CPU kernel variant {name!r}; expected one of {', '.join(NAMES)}")


def rank(name: str) -> int:
    return NAMES.index(name)


def runs_on(name: str, features: set[str] | frozenset[str]) -> bool:
    """Whether a CPU with these features runs the variant."""
    return set(get(name).requires) <= set(features)


def variant_flags(v: Variant) -> list[str]:
    """Every compile flag of one variant's translation units."""
    return [*COMMON_FLAGS, f"-DVLLITE_CPU_ISA={v.namespace}", *v.flags]
