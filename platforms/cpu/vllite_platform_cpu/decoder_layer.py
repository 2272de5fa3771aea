"""A pre-norm decoder layer in one C++ call (``csrc/decoder.cpp``), for ``CpuModelOps.decoder_layer``.

The layer is known only through its typed record (``model_registry.layers.fast_path.DecoderLayerRecord``), never
through a model's attribute names; a record the C++ layer does not compute (or a model's reason for giving none)
is logged once (``why_not``).

Why: a batch-1 decode step of SmolLM2-135M (30 small layers) spent a third or more of its forward in the
~9 Python-level op calls per layer around the kernels (benchmarks/decode_forward.py --split). The C++ side
runs the same kernels in the same order, so its results are the Python path's bit for bit; this side
decides, per call and cheaply, whether it applies, and otherwise returns None (the layer then runs its
Python code): no LoRA on any of the layer's linears, no grad, the activations' dtype, the C++ paged
attention's plan, a cache in the activations' dtype (no float8 scales), and every linear on a kernel the
C++ side calls for this many rows (what ``CpuModelOps.linear``, ``gguf_linear`` and ``quant_linear`` would choose:
pre-quantized W4A16 / GPTQ / AWQ / FP8 weights on csrc/wna16.cpp's and csrc/fp8_linear.cpp's kernels). The AVX2
GEMM's panels are the ones ``CpuModelOps.linear`` keeps in the layer's ``state``, repacked by the same
code when the weight changes.

``NativeDecoderStack`` takes all of a model's layers in one C++ call (``llama_decoder_stack``), each layer's
fixed arguments made once as a ``DecoderLayerSpec`` (remade when a weight the C++ side reads changes); at a few
rows it holds the threads as one team for the call (csrc/team.h), and from ``SPLIT_MIN_ROWS_PER_THREAD`` rows a
thread it gives each thread its own share of the requests through every layer (csrc/decoder.cpp, split_step).
"""
from __future__ import annotations

import functools
import glob
import logging
from typing import Any

import torch

from model_registry.layers.fast_path import DecoderLayerRecord
from model_registry.layers.quantization.gguf import GGUFLinearMethod
from model_registry.layers.quantization.int8 import Int8LinearMethod
from model_registry.layers.quantization.prequant import PrequantLinearMethod
from vllite_platform_cpu import kernels
from vllite_platform_cpu.attention import TorchPagedAttention, _Plan
from vllite_platform_cpu.model_ops import _KERNEL_DTYPES, SMALL_LINEAR_MAX_ROWS, fp8_act_args, quant_route

_PANELS, _PLAIN, _BF16, _INT8, _GGUF = 0, 1, 2, 3, 16  # csrc/decoder.cpp's linear kinds (_GGUF + ggml type id)
# Pre-quantized weights' kinds, by CpuModelOps.quant_linear's route (model_ops.quant_route).
_QUANT = {"int4": 4, "int4_q8": 5, "fp8": 6}
# Kinds whose packed weight CpuModelOps keeps in the layer's state: their route ("int8": CpuModelOps.pack_int8).
_PACKED = {_PANELS: "avx2", _BF16: "bf16", _INT8: "int8"}

logger = logging.getLogger("vllite.platform.cpu")
_TOLD: set[str] = set()  # the reasons a layer does not take the one-call path, each logged once per process


def why_not(ops: Any, record: DecoderLayerRecord | str) -> str | None:
    """Why a layer never takes the C++ path (None: it may, step by step): what the model said, or what of its
    record the C++ layer does not compute."""
    if isinstance(record, str):
        return record
    dt = record.input_norm.weight.dtype
    if not ops.fused:
        return "the fused kernels are off (VLLITE_CPU_FUSED=0)"
    if not kernels.available():
        return "the C++ kernels are not built"
    if dt not in _KERNEL_DTYPES:
        return f"the model dtype {dt} has no C++ kernels"
    if record.input_norm.kind != "rms" or record.post_attention_norm.kind != "rms":
        return "a norm other than RMSNorm"
    if record.post_attention_norm.weight.dtype != dt or record.input_norm.eps != record.post_attention_norm.eps:
        return "its two norms differ in dtype or eps"
    if record.activation != "silu" or record.rope not in ("neox", None):
        return f"activation {record.activation!r} / rope {record.rope!r} (the C++ layer: silu, neox or none)"
    if type(record.attention.backend).forward is not TorchPagedAttention.forward:
        return f"attention backend {type(record.attention.backend).__name__} (the C++ layer: the CPU paged one)"
    if record.o_proj.tp.world_size != 1 or record.down_proj.tp.world_size != 1:
        return "tensor parallelism (its all-reduces run between the layer's parts)"
    linears = (record.qkv_proj, record.o_proj, record.gate_up_proj, record.down_proj)
    if record.ops is not ops or any(lin.ops is not ops for lin in linears):
        return "parts built with other model ops than the platform's"
    return None


_IDENTITY: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}  # (head size, dtype) -> tables


def identity_rope(rows: int, head_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos = 1 and sin = 0 for ``rows`` tokens: the C++ layer's rotation of a layer without RoPE is then
    ``x * 1 + rotate_half(x) * 0``, x itself. One table per head size and dtype, grown to the most rows
    asked, its leading rows returned (contiguous)."""
    tables = _IDENTITY.get((head_size, dtype))
    if tables is None or tables[0].shape[0] < rows:
        n = max(rows, 2 * tables[0].shape[0] if tables is not None else 64)
        tables = _IDENTITY[(head_size, dtype)] = (torch.ones(n, head_size, dtype=dtype),
                                                 torch.zeros(n, head_size, dtype=dtype))
    return tables[0][:rows], tables[1][:rows]


def tell(reason: str) -> None:
    """Log once per process that layers stay on the Python path, and why."""
    if reason not in _TOLD:
        _TOLD.add(reason)
        logger.info("cpu decoder layers: the one-call C++ path is off for a layer: %s", reason)


class NativeDecoderLayer:
    """Callable ``(rope, x, residual, kv_cache, metadata) -> (out, residual) | None`` for one layer; a layer
    without RoPE (``record.rope`` None) ignores ``rope`` and rotates by identity tables (``identity_rope``)."""

    def __init__(self, ops: Any, record: DecoderLayerRecord) -> None:
        attn = record.attention
        self.ops = ops
        self.fn = kernels.load().llama_decoder_layer
        self.dt = record.input_norm.weight.dtype
        self.rope = record.rope
        self.norms = (record.input_norm.weight, record.post_attention_norm.weight)
        self.eps = float(record.input_norm.eps)
        self.linears = (record.qkv_proj, record.o_proj, record.gate_up_proj, record.down_proj)
        self.kv_scales = attn.kv_scales
        self.backend = attn.backend
        self.heads = (attn.num_heads, attn.num_kv_heads, attn.head_size)
        self.scale, self.window = float(attn.scale), int(attn.sliding_window or 0)
        self.held: tuple = ()  # per linear (weight, bias, int8 scale): the objects the routes were made for
        self.routes: dict[bool, tuple | None] = {}
        self.specs: dict[bool, tuple] = {}  # small -> (what it was made from, DecoderLayerSpec)
        self._prepare()

    @classmethod
    def build(cls, ops: Any, record: DecoderLayerRecord | str) -> NativeDecoderLayer | None:
        """The callable, or None when this layer never takes the C++ path (the reason logged once)."""
        reason = why_not(ops, record)
        if reason is None:
            assert not isinstance(record, str)
            native = cls(ops, record)
            if any(r is not None for r in native.routes.values()):
                return native
            reason = "no linear layout of its own on the C++ kernels at any row count"
        tell(reason)
        return None

    def _prepare(self) -> None:
        """Each linear's kernel for few rows (True) and more rows (False) as the C++ call's argument lists
        (kinds, weights, biases, output features, the linears whose panels are fetched per call), None
        where one of them is not the C++ side's."""
        self.held = tuple((lin._parameters["weight"], lin._parameters.get("bias"), lin.quant_method)
                          for lin in self.linears)
        for small in (True, False):
            specs = [self._spec(lin, 1 if small else SMALL_LINEAR_MAX_ROWS + 1) for lin in self.linears]
            if any(s is None for s in specs):
                self.routes[small] = None
                continue
            kinds, weights, biases, widths, quant, quant_args = (list(col) for col in zip(*specs))
            panels = tuple(i for i, k in enumerate(kinds) if k in _PACKED)
            self.routes[small] = (kinds, weights, biases, widths, panels, quant, quant_args)

    def _spec(self, lin: Any, rows: int) -> tuple | None:
        """(kind, weight or None (the panels, fetched per call), bias, output features, a pre-quantized weight's
        tensors and arguments) of one linear."""
        spec = self._spec_of(lin, rows)
        return None if spec is None else (*spec, [], []) if len(spec) == 4 else spec

    def _spec_of(self, lin: Any, rows: int) -> tuple | None:
        bias, method = lin.bias, lin.quant_method
        if isinstance(method, GGUFLinearMethod):
            w = method.gguf_weight
            return (_GGUF + w.type_id, w.blocks, bias, w.shape[0]) if w.shape[1] % 32 == 0 else None
        if bias is not None and bias.dtype != self.dt:
            return None
        if isinstance(method, PrequantLinearMethod):
            return self._quant_spec(method, bias)
        weight = lin.weight
        if isinstance(method, Int8LinearMethod):  # W8A8: the int8 GEMM at every row count, as CpuModelOps.int8_linear
            ok = weight.dtype == torch.int8 and self.ops.int8_route(self.dt, weight)
            return (_INT8, None, None, weight.shape[0]) if ok else None
        if weight.dtype != self.dt or weight.dim() != 2:
            return None
        route = self.ops.linear_route(self.dt, rows, weight)
        if route == "small":
            return (_PLAIN, weight, bias, weight.shape[0])
        if route == "avx2":
            return (_PANELS, None, None, weight.shape[0])
        if route == "bf16":
            return (_BF16, None, None, weight.shape[0])
        return None

    def _quant_spec(self, method: PrequantLinearMethod, bias: torch.Tensor | None) -> tuple | None:
        """A pre-quantized weight on the kernel ``CpuModelOps.quant_linear`` takes (no column permutation: act-order
        weights stay on the Python path), its scales, zero points (an empty tensor: one symmetric zero) and (group,
        zero, fp8 activation mode, group, static scale)."""
        w = method.weight
        route = None if w is None or w.perm is not None else quant_route(self.dt, w)
        act = fp8_act_args(w) if route == "fp8" else (0, 0, 0.0)
        if route is None or act is None:
            return None
        zeros = w.zeros if w.zeros is not None else torch.empty(0)
        args = [float(w.group), float(w.zero), *map(float, act)]
        return (_QUANT[route], w.codes, bias, w.rows, [w.scales, zeros], args)

    @staticmethod
    def _scale(lin: Any) -> torch.Tensor | None:
        method = lin.quant_method
        return method.weight_scale if isinstance(method, Int8LinearMethod) else None

    def _usable(self) -> bool:
        """Per step: no LoRA slot on a linear, the weight, bias and int8 scale objects the routes were made for
        (else made again: the stack's specs hold the old ones, so only this sees a swap), no float8 cache
        scales."""
        # Module attributes through _parameters (nn.Module.__getattr__ costs a microsecond per lookup).
        for lin, (w, b, m) in zip(self.linears, self.held):
            if lin.lora is not None:
                return False
            params = lin._parameters
            if params["weight"] is not w or params.get("bias") is not b or lin.quant_method is not m:
                self._prepare()  # quantized or swapped since: choose the kernels again
                break
        ks = self.kv_scales
        return not (ks.calculate or (ks.active and (ks.k_scale != 1.0 or ks.v_scale != 1.0)))

    def _linear_args(self, route: tuple) -> tuple[list, list, list]:
        """(kinds, weights, biases) of a route for this call: the AVX2 GEMM's panels are the ones
        CpuModelOps.linear keeps in the layer's ``state`` (repacked there when the weight changes)."""
        kinds, weights, biases, _, panels = route[:5]
        if panels:
            weights, biases = weights.copy(), biases.copy()
            for i in panels:
                lin = self.linears[i]
                params = lin._parameters
                if kinds[i] == _INT8:
                    packed = self.ops.pack_int8(params["weight"], self._scale(lin), params.get("bias"), lin.state)
                else:
                    packed = self.ops.pack_linear(params["weight"], params.get("bias"), lin.state, _PACKED[kinds[i]])
                weights[i], biases[i] = packed["packed"], packed["bias"]
        return kinds, weights, biases

    def spec(self, small: bool) -> Any:
        """This layer's ``DecoderLayerSpec`` (csrc/kernels.h) for few rows (True) or more, for
        ``NativeDecoderStack``; None where this step takes the Python path. Made again only when a weight
        the C++ side reads changes."""
        if not self._usable():
            return None
        route = self.routes[small]
        if route is None:
            return None
        kinds, weights, biases = self._linear_args(route)
        key = (id(route), *map(id, weights), *map(id, biases))
        made = self.specs.get(small)
        if made is not None and made[0] == key:
            return made[1]
        h, hkv, d = self.heads
        spec = kernels.load().DecoderLayerSpec(self.norms[0], self.norms[1], self.eps, kinds, weights, biases,
                                               route[3], route[5], route[6], h, hkv, d, self.scale, self.window,
                                               self._sources(route))
        self.specs[small] = (key, spec)
        return spec

    def _sources(self, route: tuple) -> list[torch.Tensor]:
        """The tensors a route's packed weights are made from (weight, bias, int8 scale): where one of them
        moves or changes in place, the spec is stale (``layer_specs_current``)."""
        out = []
        for i in route[4]:
            lin = self.linears[i]
            params = lin._parameters
            out += [t for t in (params["weight"], params.get("bias"), self._scale(lin)) if t is not None]
        return out

    def __call__(self, rope: tuple[torch.Tensor, torch.Tensor] | None, x: torch.Tensor,
                 residual: torch.Tensor | None, kv_cache: torch.Tensor | None,
                 md: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        dt = self.dt
        if (torch.is_grad_enabled() or x.dtype is not dt or kv_cache is None or kv_cache.dtype is not dt
                or not kv_cache.numel()):
            return None
        if not self._usable():
            return None
        if self.rope is None:
            rope = identity_rope(x.shape[0], self.heads[2], dt)
        elif rope is None:
            return None
        cos, sin = rope
        if cos.dtype is not dt or not (cos.is_contiguous() and sin.is_contiguous()):
            return None
        route = self.routes[x.shape[0] <= SMALL_LINEAR_MAX_ROWS]
        if route is None:
            return None
        plan = attention_plan(self.backend, md)
        if plan is None:
            return None
        kinds, weights, biases = self._linear_args(route)
        h, hkv, d = self.heads
        return self.fn(x, residual, self.norms[0], self.norms[1], self.eps, kinds, weights, biases, route[3], route[5],
                       route[6], cos, sin, h, hkv, d, kv_cache, plan.kernel_slots, *plan.kernel_args, plan.num_tokens,
                       self.scale, self.window, kernels.GGUF_GEMM_MIN_ROWS, kernels.GGUF_GRAIN_BYTES)


def attention_plan(backend: TorchPagedAttention, md: Any) -> _Plan | None:
    """The step's attention plan, as TorchPagedAttention.forward makes it (once, shared by the layers of the
    metadata), or None where the C++ attention does not take the step."""
    plan = md.extra
    if not isinstance(plan, _Plan):
        plan = backend._plan(md)
        if md.extra is None:
            md.extra = plan
    return plan if plan.kernel_args is not None else None


class NativeDecoderStack:
    """Callable ``(rope, x, kv_caches, metadata) -> (out, residual) | None``: all of a model's decoder layers,
    from the embedding, in one C++ call (``llama_decoder_stack`` in csrc/decoder.cpp), bit for bit what
    ``NativeDecoderLayer`` returns layer by layer.

    Why: at batch 1 the per-layer Python around each C++ layer call (checks, ~25 arguments converted, the
    decoder layer's own forward) was ~0.65 ms of a ~6 ms forward of SmolLM2's 30 layers, and each linear's
    own fork/join kept the small ones on one thread; in one call the threads are held as one team for the
    whole step (csrc/team.h). None (the layers then run one by one) when any layer or the step does not
    take the C++ path."""

    # Rows up to which the threads are held as a team for the call: decode steps (the linears' small route).
    TEAM_MAX_ROWS = SMALL_LINEAR_MAX_ROWS
    # Rows per thread from which each thread runs its own requests through every layer alone (csrc/decoder.cpp,
    # split_step), where every linear is on the bf16 or int8 GEMM (their results for a row do not depend on the
    # rows beside it). SmolLM2-135M on 2 Zen 4 cores, a decode forward against the whole step split kernel by
    # kernel (benchmarks/decode_forward.py --compare-split): 8 rows 2-40% slower (each thread reads every weight),
    # 12 rows 2-8% faster, 16 rows 3-17%, 64 rows 4-5% (docs/benchmarks-notebook.md, the eighth Zen 4 session).
    SPLIT_MIN_ROWS_PER_THREAD = 6
    # The same where the GEMMs run on AMX tiles (~10x vdpbf16ps's rate) and the weights do not fit in the last-level
    # cache: each thread then reads every weight from memory, and a thread's rows keep the tiles busy enough to hide
    # that second read only from ~64 rows. The Llama-3.2-1B shape (2.1 GB of bf16 weights, 480 MiB of L3) on 2
    # Xeon cores with AMX, a decode forward: 32 rows 158 ms split against 110 whole, 128 rows 275 against 270
    # (docs/benchmarks-notebook.md, 2026-12-07); SmolLM2-135M on the same host (270 MB, in L3) stays faster split.
    SPLIT_MIN_ROWS_FROM_MEMORY_AMX = 96

    def __init__(self, layers: list[NativeDecoderLayer]) -> None:
        self.layers = layers
        self.fn = kernels.load().llama_decoder_stack
        self.current = kernels.load().layer_specs_current
        self.dt = layers[0].dt
        self.backend = layers[0].backend
        self.made: dict[bool, tuple[list, list]] = {}  # small -> (the layers' specs, the routes they were made for)
        self.splittable: dict[bool, bool] = {}  # small -> whether those routes allow the split by requests
        self.amx_from_memory = False  # the GEMMs on AMX tiles, the weights larger than the last-level cache

    @classmethod
    def build(cls, layers: list[NativeDecoderLayer | None]) -> NativeDecoderStack | None:
        """The callable over these layers' one-call paths, or None when one of them has none."""
        if not layers or any(layer is None for layer in layers):
            return None
        if any(layer.dt is not layers[0].dt or layer.backend is not layers[0].backend or layer.rope != "neox"
               for layer in layers):
            return None  # one dtype, one backend, the model's RoPE tables for every layer
        return cls(layers)  # type: ignore[arg-type]

    def __call__(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, kv_caches: list[torch.Tensor],
                 metadata: list[Any]) -> tuple[torch.Tensor, torch.Tensor] | None:
        dt = self.dt
        if torch.is_grad_enabled() or x.dtype is not dt or len(kv_caches) != len(self.layers):
            return None
        cos, sin = rope
        if cos.dtype is not dt or not (cos.is_contiguous() and sin.is_contiguous()):
            return None
        small = x.shape[0] <= SMALL_LINEAR_MAX_ROWS
        for layer, cache in zip(self.layers, kv_caches):
            if cache is None or cache.dtype is not dt or not cache.numel() or not layer._usable():
                return None
        specs = self._specs(small)
        if specs is None:
            return None
        plans: dict[int, int] = {}  # id(metadata) -> plan index: the layers of one cache group share one
        tensors: list[torch.Tensor] = []
        of_layer = []
        num_tokens = 0
        for md in metadata:
            j = plans.get(id(md))
            if j is None:
                plan = attention_plan(self.backend, md)
                if plan is None:
                    return None
                j = plans[id(md)] = len(plans)
                tensors += (plan.kernel_slots, *plan.kernel_args)
                num_tokens = plan.num_tokens
            of_layer.append(j)
        split = 0
        if self.splittable[small]:
            split = self.SPLIT_MIN_ROWS_FROM_MEMORY_AMX if self.amx_from_memory else self.SPLIT_MIN_ROWS_PER_THREAD
        return self.fn(x, specs, cos, sin, kv_caches, tensors, of_layer, num_tokens, self.TEAM_MAX_ROWS, split,
                       kernels.GGUF_GEMM_MIN_ROWS, kernels.GGUF_GRAIN_BYTES)

    def _specs(self, small: bool) -> list | None:
        """The layers' specs for this many rows (after each layer's ``_usable``): the ones of the last step
        while their routes and the tensors their panels were made from are unchanged (checked in one C++ call:
        re-checking each packed linear's key in Python was ~0.3 ms of a batch-64 step), else made again."""
        made = self.made.get(small)
        routes = [layer.routes[small] for layer in self.layers]
        if made is not None and all(a is b for a, b in zip(made[1], routes)) and self.current(made[0]):
            return made[0]
        specs = [layer.spec(small) for layer in self.layers]
        if any(spec is None for spec in specs):
            return None
        self.made[small] = (specs, routes)
        self.splittable[small] = all(k in (_BF16, _INT8) for route in routes for k in route[0])
        weight_bytes = sum(w.numel() * w.element_size() for layer in self.layers for lin in layer.linears
                           if isinstance(w := lin._parameters["weight"], torch.Tensor))
        self.amx_from_memory = amx_gemms() and weight_bytes > last_level_cache_bytes()
        return specs


@functools.cache
def last_level_cache_bytes() -> int:
    """The size of this CPU's largest cache as Linux reports it (0 where it does not)."""
    sizes = [0]
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        if text[:-1].isdigit() and text[-1] in units:
            sizes.append(int(text[:-1]) * units[text[-1]])
        elif text.isdigit():
            sizes.append(int(text))
    return max(sizes)


def amx_gemms() -> bool:
    """The bf16 and int8 GEMMs run on AMX tiles here (platform.use_amx, and the CPU and kernels have them)."""
    from vllite_platform_cpu.platform import use_amx

    return use_amx() and kernels.amx_available()
