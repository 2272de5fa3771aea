"""A Llama-style decoder layer in one C++ call (``csrc/decoder.cpp``), for ``CpuModelOps.decoder_layer``.

Why: a batch-1 decode step of SmolLM2-135M (30 small layers) spent a third or more of its forward in the
~9 Python-level op calls per layer around the kernels (benchmarks/decode_forward.py --split). The C++ side
runs the same kernels in the same order, so its results are the Python path's bit for bit; this side
decides, per call and cheaply, whether it applies, and otherwise returns None (the layer then runs its
Python code): no LoRA on any of the layer's linears, no grad, the activations' dtype, the C++ paged
attention's plan, a cache in the activations' dtype (no float8 scales), and every linear on a kernel the
C++ side calls for this many rows (what ``CpuModelOps.linear`` and ``gguf_linear`` would choose). The AVX2
GEMM's panels are the ones ``CpuModelOps.linear`` keeps in the layer's ``_state``, repacked by the same
code when the weight changes.
"""
from __future__ import annotations

from typing import Any

import torch

from vllite_platform_cpu import kernels
from vllite_platform_cpu.attention import TorchPagedAttention, _Plan
from vllite_platform_cpu.model_ops import _KERNEL_DTYPES, SMALL_LINEAR_MAX_ROWS

_PANELS, _PLAIN, _GGUF = 0, 1, 16  # csrc/decoder.cpp's linear kinds (_GGUF + ggml type id)


class NativeDecoderLayer:
    """Callable ``(rope, x, residual, kv_cache, metadata) -> (out, residual) | None`` for one layer."""

    def __init__(self, ops: Any, layer: Any) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.ops = ops
        self.fn = kernels.load().llama_decoder_layer
        self.dt = layer.input_layernorm.weight.dtype
        self.norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        self.eps = float(layer.input_layernorm.eps)
        self.linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        self.kv_scales = attn.kv_scales
        self.backend = attn.attn_backend
        self.heads = (attn.num_heads, attn.num_kv_heads, attn.head_size)
        self.scale, self.window = float(attn.scale), int(attn.sliding_window or 0)
        self.weights: tuple = ()
        self.routes: dict[bool, tuple | None] = {}
        self._prepare()

    @classmethod
    def build(cls, ops: Any, layer: Any) -> NativeDecoderLayer | None:
        """The callable, or None when this layer never takes the C++ path (see the module docstring)."""
        attn, mlp = layer.self_attn, layer.mlp
        dt = layer.input_layernorm.weight.dtype
        if not (ops.fused and kernels.available() and dt in _KERNEL_DTYPES
                and layer.post_attention_layernorm.weight.dtype == dt
                and layer.input_layernorm.eps == layer.post_attention_layernorm.eps
                and type(attn.attn_backend).forward is TorchPagedAttention.forward
                and attn.o_proj.tp.world_size == 1 and mlp.down_proj.tp.world_size == 1
                and all(part._ops is ops for part in (layer.input_layernorm, layer.post_attention_layernorm, attn, mlp,
                                                      attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))):
            return None
        native = cls(ops, layer)
        return native if any(r is not None for r in native.routes.values()) else None

    def _prepare(self) -> None:
        """Each linear's kernel for few rows (True) and more rows (False) as the C++ call's argument lists
        (kinds, weights, biases, output features, the linears whose panels are fetched per call), None
        where one of them is not the C++ side's."""
        self.weights = tuple(lin._parameters["weight"] for lin in self.linears)
        for small in (True, False):
            specs = [self._spec(lin, 1 if small else SMALL_LINEAR_MAX_ROWS + 1) for lin in self.linears]
            if any(s is None for s in specs):
                self.routes[small] = None
                continue
            kinds, weights, biases, widths = (list(col) for col in zip(*specs))
            panels = tuple(i for i, k in enumerate(kinds) if k == _PANELS)
            self.routes[small] = (kinds, weights, biases, widths, panels)

    def _spec(self, lin: Any, rows: int) -> tuple | None:
        """(kind, weight or None (the panels, fetched per call), bias, output features) of one linear."""
        bias = lin.bias
        if lin.gguf_weight is not None:
            w = lin.gguf_weight
            return (_GGUF + w.type_id, w.blocks, bias, w.shape[0]) if w.shape[1] % 32 == 0 else None
        weight = lin.weight
        if (lin.weight_scale is not None or weight.dtype != self.dt or weight.dim() != 2
                or (bias is not None and bias.dtype != self.dt)):
            return None
        route = self.ops.linear_route(self.dt, rows, weight)
        if route == "small":
            return (_PLAIN, weight, bias, weight.shape[0])
        if route == "avx2":
            return (_PANELS, None, None, weight.shape[0])
        return None

    def __call__(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, residual: torch.Tensor | None,
                 kv_cache: torch.Tensor | None, md: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        dt = self.dt
        if (torch.is_grad_enabled() or x.dtype is not dt or kv_cache is None or kv_cache.dtype is not dt
                or not kv_cache.numel()):
            return None
        linears = self.linears
        # Module attributes through _parameters (nn.Module.__getattr__ costs a microsecond per lookup).
        for lin, w in zip(linears, self.weights):
            if lin.lora is not None:
                return None
            if lin._parameters["weight"] is not w:  # quantized or swapped since: choose the kernels again
                self._prepare()
                break
        ks = self.kv_scales
        if ks.calculate or (ks.active and (ks.k_scale != 1.0 or ks.v_scale != 1.0)):
            return None
        cos, sin = rope
        if cos.dtype is not dt or not (cos.is_contiguous() and sin.is_contiguous()):
            return None
        route = self.routes[x.shape[0] <= SMALL_LINEAR_MAX_ROWS]
        if route is None:
            return None
        plan = md.extra
        if not isinstance(plan, _Plan):  # as TorchPagedAttention.forward: made once, shared by the layers
            plan = self.backend._plan(md)
            if md.extra is None:
                md.extra = plan
        if plan.kernel_args is None:
            return None
        kinds, weights, biases, widths, panels = route
        if panels:  # the AVX2 GEMM's panels, shared with CpuModelOps.linear (repacked when the weight changes)
            weights, biases = weights.copy(), biases.copy()
            for i in panels:
                lin = linears[i]
                params, state = lin._parameters, lin._state
                self.ops.pack_linear(params["weight"], params.get("bias"), state, True)
                weights[i], biases[i] = state["packed"], state["bias"]
        h, hkv, d = self.heads
        return self.fn(x, residual, self.norms[0], self.norms[1], self.eps, kinds, weights, biases, widths, cos, sin,
                       h, hkv, d, kv_cache, plan.kernel_slots, *plan.kernel_args, plan.num_tokens, self.scale,
                       self.window, kernels.GGUF_GEMM_MIN_ROWS, kernels.GGUF_GRAIN_BYTES)
