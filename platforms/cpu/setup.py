"""Build of vllite-platform-cpu: the package and its C++ kernels, one extension module with every ISA variant.

    pip install --no-build-isolation --no-deps -e platforms/cpu    (scripts/setup.sh)

``--no-build-isolation``: the kernels compile against the torch of the environment they will run in
(pyproject's build requirements leave torch out, so an isolated build never downloads another one).
``vllite_platform_cpu._C`` holds csrc/bindings.cpp (baseline flags) and the kernel files (``isa.KERNEL_SOURCES``)
compiled once per variant of ``vllite_platform_cpu/isa.py`` with that variant's flags and
namespace (all compiles in parallel, ``MAX_JOBS`` or one per CPU at a time); ``kernels.py`` picks the
variant at run time. The objects are linked lowest variant first:
where several variants emit the same inline function (the standard library's, c10's), the linker keeps
the first copy, so the one the module uses is always one that the lowest CPU using it can run.

Without torch at build time (an isolated build) or when compiling fails (no compiler), the package is
installed without the module and ``kernels.py`` builds the host's variant on first use. Environment:
``VLLITE_CPU_BUILD_EXT`` = ``1`` (default: build, failures are warnings), ``required`` (failures are
errors) or ``0`` (skip); ``VLLITE_CPU_VARIANTS=default,avx2`` builds only those variants. The build
folder (``build/``) is kept, so a reinstall recompiles only what changed.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join("vllite_platform_cpu", "csrc")  # relative: setuptools wants relative source paths


def _load_isa():
    """vllite_platform_cpu/isa.py by path: importing the package would need vllite and torch."""
    path = os.path.join(HERE, "vllite_platform_cpu", "isa.py")
    spec = importlib.util.spec_from_file_location("_vllite_cpu_isa", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # NamedTuple needs its module registered
    spec.loader.exec_module(mod)
    return mod


isa = _load_isa()
MODE = os.environ.get("VLLITE_CPU_BUILD_EXT", "1").strip().lower()


def _say(msg: str) -> None:
    print(f"vllite-platform-cpu: {msg}", file=sys.stderr)


@contextlib.contextmanager
def _locked(path: str):
    """An exclusive lock on a file: two installs from this tree at once take turns in the build folder."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _wanted_variants():
    chosen = os.environ.get("VLLITE_CPU_VARIANTS", "").strip()
    variants = isa.variants()
    if chosen:
        names = {n.strip() for n in chosen.split(",") if n.strip()}
        for n in names:
            isa.get(n)  # raises on an unknown name
        variants = tuple(v for v in variants if v.name in names)
    return variants


def _extension_and_cmdclass():
    if MODE in ("0", "no", "false", "off"):
        _say("VLLITE_CPU_BUILD_EXT=0: installing without the compiled kernels (built on first use instead)")
        return [], {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError as e:
        if MODE == "required":
            raise
        _say(f"torch is not importable at build time ({e}; install with --no-build-isolation into the "
             "environment that has torch): installing without the compiled kernels (built on first use instead)")
        return [], {}

    class BuildVariants(BuildExtension):
        """BuildExtension, plus one compile of the kernel files per ISA variant, each with its own flags."""

        def build_extensions(self):
            # Python's own CFLAGS add -g (debug info: slower to compile, a 10x bigger module) and -fwrapv;
            # the first-use build (torch's cpp_extension.load) has neither, and the installed module compiles
            # as it does.
            so = getattr(self.compiler, "compiler_so", None)
            if isinstance(so, list):
                self.compiler.compiler_so = [f for f in so if f not in ("-g", "-fwrapv")]
            super().build_extensions()

        def build_extension(self, ext):
            # A build folder that outlives the install (pip's editable builds use a fresh temporary one), one
            # per environment: ninja then recompiles only what changed, and re-running scripts/setup.sh
            # takes seconds.
            env = hashlib.sha256(sys.prefix.encode()).hexdigest()[:8]
            tag = f"temp.{sysconfig.get_platform()}-{sys.implementation.cache_tag}-{env}"
            self.build_temp = os.path.join(HERE, "build", tag)
            os.makedirs(self.build_temp, exist_ok=True)
            with _locked(os.path.join(self.build_temp, ".lock")):
                self._build_extension(ext)

        def _build_extension(self, ext):
            try:
                variants = [v for v in ext.vllite_variants if self._compiler_accepts(v)]
                self._compile_variants(ext, variants)
                super().build_extension(ext)
            except Exception as e:  # noqa: BLE001 - a failed build leaves the first-use build to kernels.py
                if MODE == "required":
                    raise
                _say(f"building the C++ kernels failed ({type(e).__name__}: {e}): installing without them; "
                     "kernels.py builds them on first use (VLLITE_CPU_BUILD_EXT=required makes this an error)")

        def copy_file(self, infile, outfile, *args, **kwargs):
            """The editable install's copy of the module into the source tree, atomically: a process that
            has the old one loaded keeps its (still intact) file instead of crashing on a rewritten one."""
            if not str(infile).endswith((".so", ".pyd", ".dylib")) or os.path.isdir(outfile):
                return super().copy_file(infile, outfile, *args, **kwargs)
            tmp = f"{outfile}.tmp{os.getpid()}"
            shutil.copy2(infile, tmp)
            os.replace(tmp, outfile)
            return outfile, 1

        def _compiler_accepts(self, v) -> bool:
            cxx = getattr(self.compiler, "compiler_so", None) or ["c++"]
            with tempfile.TemporaryDirectory() as tmp:
                src = os.path.join(tmp, "probe.cpp")
                with open(src, "w") as f:
                    f.write("int main() { return 0; }\n")
                r = subprocess.run([*cxx, *v.flags, "-c", src, "-o", os.path.join(tmp, "probe.o")],
                                   capture_output=True, text=True)
            if r.returncode != 0:
                _say(f"the compiler rejects the {v.name} variant's flags, skipping it: {r.stderr.strip()[-300:]}")
            return r.returncode == 0

        def _compile_variants(self, ext, variants):
            """Every kernel file once per variant, and bindings.cpp, in parallel (one ninja run each: torch's
            ninja build takes one set of flags per run); super().build_extension then finds bindings.o
            up to date and links."""
            base = ext.extra_compile_args
            base = list(base["cxx"] if isinstance(base, dict) else base)  # torch's flags included by now
            # bindings.cpp (the baseline flags) registers the variants built and what they were built from.
            bindings = [*base, *(f"-DVLLITE_CPU_WITH_{v.namespace}" for v in variants),
                        f"-DVLLITE_CPU_SOURCES_DIGEST={isa.sources_digest(os.path.join(HERE, CSRC))}"]
            if isinstance(ext.extra_compile_args, dict):
                ext.extra_compile_args["cxx"] = bindings
            else:
                ext.extra_compile_args = bindings
            macros = [*ext.define_macros, *((u,) for u in ext.undef_macros)]
            # (sources, output folder, flags): the same call for bindings.cpp as build_ext's own.
            jobs = [(ext.sources, self.build_temp, bindings)]
            kernel_jobs = {}
            for v in variants:
                for src in isa.KERNEL_SOURCES:
                    out_dir = os.path.join(self.build_temp, v.namespace, os.path.splitext(src)[0])
                    kernel_jobs[v.name, src] = ([os.path.join(CSRC, src)], out_dir, [*base, *isa.variant_flags(v)])
            # Longest first: bindings.cpp (torch/extension.h), then attention.cpp of every variant.
            jobs += sorted(kernel_jobs.values(), key=lambda j: not j[0][0].endswith("attention.cpp"))
            for _, out_dir, _ in jobs:
                os.makedirs(out_dir, exist_ok=True)

            def compile_one(job):
                sources, out_dir, flags = job
                return self.compiler.compile(sources, output_dir=out_dir, macros=macros, include_dirs=ext.include_dirs,
                                             debug=self.debug, extra_postargs=flags, depends=ext.depends)

            if self.use_ninja:  # each job its own ninja run and folder; the plain compiler is not thread-safe
                cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
                workers = int(os.environ.get("MAX_JOBS") or cpus or 1)
                with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
                    done = dict(zip(map(id, jobs), pool.map(compile_one, jobs)))
            else:
                done = {id(j): compile_one(j) for j in jobs}
            # Lowest variant first: the link order (see the module docstring).
            ext.extra_objects = [o for v in variants for src in isa.KERNEL_SOURCES
                                 for o in done[id(kernel_jobs[v.name, src])]]

    csrc_files = sorted(os.path.join(CSRC, f) for f in os.listdir(os.path.join(HERE, CSRC))
                        if f.endswith((".cpp", ".h")))
    ext = CppExtension(
        "vllite_platform_cpu._C", [os.path.join(CSRC, isa.BINDINGS_SOURCE)],
        include_dirs=[os.path.join(HERE, CSRC)], depends=csrc_files + [os.path.join("vllite_platform_cpu", "isa.py")],
        extra_compile_args={"cxx": [*isa.COMMON_FLAGS]}, extra_link_args=[*isa.LINK_FLAGS])
    ext.vllite_variants = _wanted_variants()
    ext.optional = MODE != "required"
    return [ext], {"build_ext": BuildVariants}


ext_modules, cmdclass = _extension_and_cmdclass()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
