"""The CPU platform's model ops: oneDNN-prepacked linear layers and the C++ fused pointwise kernels.

Each op checks that its inputs are what its kernel handles and otherwise hands the call to the torch
defaults (``vllite_core.model_ops.ModelOps``), so a model never depends on the kernels being built.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from model_registry.layers.fast_path import DecoderLayerRecord
from model_registry.layers.quantization.quant_weight import QuantWeight, fake_quant
from vllite_core.attention.encoder import PackedPrompts
from vllite_core.lora.mapping import LoRAMapping
from vllite_core.model_ops import ModelOps, quantize_rows_int8
from vllite_platform_cpu import kernels

# Up to this many rows the weight-streaming C++ kernel beats a GEMM (memory-bound, few FLOPs per byte).
SMALL_LINEAR_MAX_ROWS = 4
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def onednn_linear_available() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def _identity(t: torch.Tensor) -> tuple[int, int]:
    """Where a tensor's values live and how often they were changed in place (an inference tensor, made under
    ``torch.inference_mode``, has no version counter: its values cannot change outside that mode)."""
    return t.data_ptr(), (0 if t.is_inference() else t._version)


_ARGMAX_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CpuModelOps(ModelOps):
    """Fused kernels when ``fused`` (the C++ extension built), prepacked weights when ``packed_linear``
    (oneDNN's layout, or the AVX2 GEMM's panels when ``avx2_gemm``), 16-bit layers computed through
    float32 when ``widen_16bit`` (no native bf16/fp16 math), bfloat16 layers on the AVX512-BF16 GEMM
    when ``bf16_gemm`` (native bf16 math; at every row count), and int8 (W8A8) layers on the AVX512-VNNI GEMM
    when ``int8_gemm``; the fused MoE op in one C++ call per layer where the AVX2 GEMM runs (``moe_one_call``)."""

    def __init__(self, fused: bool, packed_linear: bool, widen_16bit: bool = False, avx2_gemm: bool = False,
                 bf16_gemm: bool = False, int8_gemm: bool = False, int8_panels: bool = False,
                 moe_one_call: bool = True) -> None:
        self.fused = fused
        self.packed_linear = packed_linear
        self.widen_16bit = widen_16bit
        self.avx2_gemm = avx2_gemm and fused
        self.bf16_gemm = bf16_gemm and fused and not widen_16bit and kernels.bf16_gemm_available()
        self.int8_gemm = int8_gemm and fused and kernels.int8_gemm_available()
        self._panel_dtypes = kernels.avx2_gemm_dtypes() if self.avx2_gemm else ()  # weight dtypes its panels hold
        # W8A8 on the AVX2 GEMM's bfloat16 panels where the CPU has no int8 dot product (int8_linear_panels)
        self.int8_panels = (int8_panels and self.avx2_gemm and not self.int8_gemm
                            and torch.bfloat16 in self._panel_dtypes)
        self.moe_one_call_on = moe_one_call and self.avx2_gemm  # fused_moe in one C++ call (csrc/moe.cpp)
        parts = (("cpu-fused", fused), ("avx2-gemm", self.avx2_gemm), ("bf16-gemm", self.bf16_gemm),
                 ("int8-gemm", self.int8_gemm), ("int8-panels", self.int8_panels),
                 ("onednn-linear", packed_linear and not self.avx2_gemm))
        self.name = "+".join(n for n, on in parts if on) or "torch"

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: dict) -> torch.Tensor:
        """Where the AVX2 GEMM is built (AVX2 hosts without AVX-512) every float32 GEMM goes to it, at
        any row count: its packed panels stream the weight from memory faster than oneDNN's kernel and,
        at 1-4 rows, than the weight-streaming kernel on the plain weight. So does every bfloat16/float16
        layer there (no native 16-bit math): its panels keep the 16-bit values, widened to float32 in
        registers, so a decode step reads half the bytes of float32 panels and no float32 copy is kept.
        Otherwise up to SMALL_LINEAR_MAX_ROWS rows go to that C++ kernel, which streams the weight as
        stored (16-bit widened in registers), and more rows to oneDNN's blocked layout, which made this
        model's linear layers 1.1-1.3x faster than F.linear (MKL) at 64-2048 rows and the LM head 2x at
        64 rows. A packed copy is made on first use and remade when the weight changes (an in-place
        load bumps its version). On a CPU without native 16-bit math (``widen_16bit``) a
        bfloat16/float16 layer multiplies its exactly widened weight with the widened input in float32
        and rounds the result: every product of two 16-bit floats is exact in float32, so this is the
        16-bit matmul's own arithmetic (float32 accumulation), at float32 speed instead of torch's
        emulated 16-bit GEMM (6x slower on AVX2). Only oneDNN's path (above 4 rows on a host without
        the AVX2 GEMM) keeps a float32 copy of the weight for it."""
        dt = x.dtype
        if (x.dim() != 2 or dt != weight.dtype or dt not in _KERNEL_DTYPES or x.device.type != "cpu"
                or torch.is_grad_enabled() or (bias is not None and bias.dtype != dt)):
            return super().linear(x, weight, bias, state)
        route = self.linear_route(dt, x.shape[0], weight)
        if route == "bf16":
            packed = self.pack_linear(weight, bias, state, route)
            out = torch.empty(x.shape[0], weight.shape[0], dtype=dt)
            kernels.bf16_gemm(out, x.contiguous(), packed["packed"], packed["bias"])
            return out
        if route == "small":
            out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
            kernels.small_linear(out, x.float().contiguous(), weight, None if bias is None else bias.float())
            return out if dt == torch.float32 else out.to(dt)
        if route == "torch":
            return super().linear(x, weight, bias, state)
        avx2 = route == "avx2"
        gemm_dt = torch.float32 if avx2 or dt == torch.float32 or self.widen_16bit else dt
        packed = self.pack_linear(weight, bias, state, route)
        xg = x.to(gemm_dt).contiguous()
        if avx2:
            out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
            kernels.avx2_gemm(out, xg, packed["packed"], packed["bias"])
        elif self.packed_linear:
            out = torch.ops.mkldnn._linear_pointwise(xg, packed["packed"], packed["bias"], "none", [], "")
        else:
            out = F.linear(xg, packed["packed"], packed["bias"])
        return out if dt == gemm_dt else out.to(dt)

    def linear_route(self, dt: torch.dtype, rows: int, weight: torch.Tensor) -> str:
        """Which kernel ``linear`` runs for ``rows`` rows of a ``dt`` layer (inputs already checked): "bf16"
        (the AVX512-BF16 GEMM's panels), "small" (small_linear on the plain weight), "avx2" (the AVX2 GEMM's
        panels), "onednn" (oneDNN's packed weight, or F.linear on the widened copy), or "torch" (the default
        op)."""
        # With native bf16 math the AVX512-BF16 GEMM takes every row count (csrc/gemm.cpp: 1.7x oneDNN's
        # packed bf16 kernel at one row, 1.2x at 64 on Zen 4); without it oneDNN's kernel streams the weight
        # as fast as small_linear at one row (and 1.5-2x faster at four rows, 2x on the LM head), so it takes
        # every row count there.
        if dt == torch.bfloat16 and self.bf16_gemm and weight.shape[1] % 2 == 0:
            return "bf16"
        native_16bit = dt == torch.bfloat16 and not self.widen_16bit and self.packed_linear
        avx2 = self.avx2_gemm and (dt == torch.float32 or self.widen_16bit)
        panel_dt = dt if dt in self._panel_dtypes else torch.float32  # the AVX2 GEMM's packed weight
        if (self.fused and rows <= SMALL_LINEAR_MAX_ROWS and weight.is_contiguous()
                and not native_16bit and not (avx2 and panel_dt == dt)):
            return "small"
        if avx2:
            return "avx2"
        # The dtype the GEMM runs in: float32, or bfloat16 where the CPU has native bf16 math (oneDNN's
        # AVX512-BF16/AMX kernels); a 16-bit layer without native math is widened to float32.
        if dt == torch.float16 and not self.widen_16bit:
            return "torch"
        if not self.packed_linear and (dt == torch.float32 or not self.widen_16bit):
            return "torch"
        return "onednn"

    def pack_linear(self, weight: torch.Tensor, bias: torch.Tensor | None, state: dict, route: str) -> dict:
        """``state["packed"]`` and ``state["bias"]`` for ``route``: the AVX2 GEMM's panels ("avx2"), the bf16
        GEMM's ("bf16", float32 bias) or oneDNN's packed weight (or the widened copy F.linear takes) and the
        bias in the GEMM's dtype, remade when the weight or the bias changes (an in-place load bumps its
        version). Returns ``state``."""
        key = (weight.data_ptr(), weight._version, None if bias is None else (bias.data_ptr(), bias._version))
        if state.get("key") == key:
            return state
        dt = weight.dtype
        avx2 = route == "avx2"
        gemm_dt = torch.float32 if avx2 or route == "bf16" or dt == torch.float32 or self.widen_16bit else dt
        if route == "bf16":
            state["packed"] = kernels.bf16_gemm_pack(weight.detach())
        elif avx2:
            panel_dt = dt if dt in self._panel_dtypes else torch.float32
            state["packed"] = kernels.avx2_gemm_pack(weight.detach().to(panel_dt))
        else:
            w = weight.detach().to(gemm_dt)
            state["packed"] = torch.ops.mkldnn._reorder_linear_weight(w, None) if self.packed_linear else w
        state["bias"] = None if bias is None else bias.to(gemm_dt).contiguous()
        state["key"] = key
        return state

    def decoder_layer(self, record: DecoderLayerRecord | str):
        """The whole layer in one C++ call where every part of it runs on this class's kernels
        (``decoder_layer.NativeDecoderLayer``), else None (the reason logged once)."""
        from vllite_platform_cpu.decoder_layer import NativeDecoderLayer

        return NativeDecoderLayer.build(self, record)

    def decoder_stack(self, layers: list[torch.nn.Module]):
        """Every layer in one C++ call where each of them has its one-call path (``decoder_layer.NativeDecoderStack``:
        the layers' own ``NativeDecoderLayer`` objects, shared with them), else None."""
        from vllite_platform_cpu.decoder_layer import NativeDecoderStack

        natives = [getattr(layer, "native_layer", lambda: None)() for layer in layers]
        return NativeDecoderStack.build(natives)

    def linear_gelu(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    state: dict) -> torch.Tensor:
        """float32 on the AVX2 GEMM: the GELU applied to each output tile in registers before it is stored."""
        if not (self.avx2_gemm and x.dim() == 2 and x.dtype == weight.dtype == torch.float32
                and x.device.type == "cpu" and not torch.is_grad_enabled()
                and (bias is None or bias.dtype == torch.float32)):
            return super().linear_gelu(x, weight, bias, state)
        self._avx2_pack(weight, bias, state)
        out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
        kernels.avx2_gemm_gelu(out, x.contiguous(), state["packed"], state["bias"])
        return out

    def add_layer_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                       eps: float) -> torch.Tensor:
        """float32 rows: one pass per row, in place in ``x``."""
        if not (self._rows_ok(x) and self._rows_ok(residual) and x.shape == residual.shape
                and x.dtype == residual.dtype == weight.dtype == bias.dtype == torch.float32
                and weight.is_contiguous() and bias.is_contiguous()):
            return super().add_layer_norm(x, residual, weight, bias, eps)
        kernels.add_layer_norm(x, residual, weight, bias, eps)
        return x

    def encoder_attention(self, qkv: torch.Tensor, prompts: PackedPrompts, scale: float) -> torch.Tensor:
        """float32: the C++ kernel reads each (prompt, head)'s rows of ``qkv`` where they lie (no padded copies)."""
        if not (self.fused and qkv.dim() == 4 and qkv.dtype == torch.float32 and qkv.device.type == "cpu"
                and qkv.is_contiguous() and not torch.is_grad_enabled()):
            return super().encoder_attention(qkv, prompts, scale)
        out = torch.empty(qkv.shape[0], *qkv.shape[2:], dtype=torch.float32)
        kernels.encoder_attention(out, qkv, prompts.cu_seqlens, scale)
        return out

    def _avx2_pack(self, weight: torch.Tensor, bias: torch.Tensor | None, state: dict) -> None:
        """The float32 weight's GEMM panels and bias in ``state``, remade when either changes."""
        key = (weight.data_ptr(), weight._version, None if bias is None else (bias.data_ptr(), bias._version))
        if state.get("key") != key:
            state["packed"] = kernels.avx2_gemm_pack(weight.detach().float())
            state["bias"] = None if bias is None else bias.float().contiguous()
            state["key"] = key

    def int8_linear(self, x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None, state: dict) -> torch.Tensor:
        """W8A8 on the int8 GEMM (csrc/quant.cpp) where ``int8_route`` says so, else through ``torch._int_mm``
        (oneDNN's int8 GEMM: AVX512-VNNI / AVX-VNNI / AMX where the CPU has them); either way the activation
        quantized per row, exact int32 sums, scaled back in float32: the same numbers."""
        if (x.dim() != 2 or x.device.type != "cpu" or torch.is_grad_enabled() or qweight.dtype != torch.int8
                or not hasattr(torch, "_int_mm")):
            return super().int8_linear(x, qweight, weight_scale, bias, state)
        if x.stride(-1) == 1 and self.int8_route(x.dtype, qweight):
            packed = self.pack_int8(qweight, weight_scale, bias, state)
            out = torch.empty(x.shape[0], qweight.shape[0], dtype=x.dtype)
            kernels.int8_gemm(out, x, packed["packed"], packed["bias"])
            return out
        if self.int8_panels and x.stride(-1) == 1 and x.dtype in (torch.float32, torch.bfloat16):
            return self.int8_linear_panels(x, qweight, weight_scale, bias, state)
        if not (self.fused and x.stride(-1) == 1):
            xq, xs = quantize_rows_int8(x)
            y = torch._int_mm(xq, qweight.t()).float().mul_(xs[:, None]).mul_(weight_scale)
            if bias is not None:
                y.add_(bias.float())
            return y if x.dtype == torch.float32 else y.to(x.dtype)
        xq = torch.empty(x.shape, dtype=torch.int8)
        xs = torch.empty(x.shape[0], dtype=torch.float32)
        kernels.quantize_rows_int8(xq, xs, x)
        acc = torch._int_mm(xq, qweight.t())
        out = torch.empty(acc.shape, dtype=x.dtype)
        kernels.dequantize_int32(out, acc, xs, weight_scale, None if bias is None else bias.float())
        return out

    def int8_linear_panels(self, x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor,
                           bias: torch.Tensor | None, state: dict) -> torch.Tensor:
        """W8A8 where the CPU has no int8 dot product (AVX2 without VNNI), on the AVX2 GEMM: the int8 weight held
        as bfloat16 panels (every int8 value is exact in bfloat16) and the activation quantized per row as
        everywhere, its int8 values multiplied in float32. Every product of two int8 values is exact in float32
        and so is every partial sum below 2^24 (the int32 sums of the other paths; larger sums round at float32's
        last bit), then both scales and the bias. Why: ``torch._int_mm`` without VNNI ran the Llama-3.2-1B
        shape's gate_up at 32 rows 6x slower than the float32 GEMM (1B int8 decode: minutes per step); this
        runs at the bf16 panels' speed (two bytes a weight, where the VNNI GEMM reads one)."""
        key = ("int8-panels", _identity(qweight), _identity(weight_scale), None if bias is None else _identity(bias))
        if state.get("key") != key:
            state["packed"] = kernels.avx2_gemm_pack(qweight.detach().to(torch.bfloat16))
            state["scale"] = weight_scale.detach().float().contiguous()
            state["bias"] = None if bias is None else bias.detach().float().contiguous()
            state["key"] = key
        xq = torch.empty(x.shape, dtype=torch.int8)
        xs = torch.empty(x.shape[0], dtype=torch.float32)
        kernels.quantize_rows_int8(xq, xs, x.contiguous())
        acc = torch.empty(x.shape[0], qweight.shape[0], dtype=torch.float32)
        kernels.avx2_gemm(acc, xq.float(), state["packed"], None)
        acc.mul_(xs[:, None]).mul_(state["scale"])
        if state["bias"] is not None:
            acc.add_(state["bias"])
        return acc if x.dtype == torch.float32 else acc.to(x.dtype)

    def int8_route(self, dt: torch.dtype, qweight: torch.Tensor) -> bool:
        """Whether ``int8_linear`` runs ``dt`` rows (contiguous) on the int8 GEMM (csrc/quant.cpp): float32 or
        bfloat16, K a multiple of 4; the caller checked the rest."""
        return self.int8_gemm and dt in (torch.float32, torch.bfloat16) and qweight.shape[1] % 4 == 0

    def pack_int8(self, qweight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                  state: dict) -> dict:
        """``state["packed"]`` (the int8 GEMM's panels, the weight scales in them) and ``state["bias"]``
        (float32), remade when the weight, its scale or the bias changes. Returns ``state``."""
        key = ("int8", _identity(qweight), _identity(weight_scale), None if bias is None else _identity(bias))
        if state.get("key") != key:
            state["packed"] = kernels.int8_gemm_pack(qweight.detach(), weight_scale.detach())
            state["bias"] = None if bias is None else bias.detach().float().contiguous()
            state["key"] = key
        return state

    def gguf_linear(self, x: torch.Tensor, weight, bias: torch.Tensor | None, state: dict) -> torch.Tensor:
        """GGUF blocks (``quantization="gguf"``) through csrc/gguf.cpp: below ``kernels.GGUF_GEMM_MIN_ROWS`` rows
        the input quantized per 32-block to int8 and integer dot products with the blocks, from there
        dequantised panels (bfloat16 ones for a bfloat16 input on AVX512-BF16 CPUs)."""
        if not (self.fused and x.dim() == 2 and x.device.type == "cpu" and not torch.is_grad_enabled()
                and x.shape[1] % 32 == 0):
            return super().gguf_linear(x, weight, bias, state)
        if x.dtype == torch.bfloat16:  # bf16 in and out (many rows: bf16 panels where the CPU has AVX512-BF16)
            out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.bfloat16)
            kernels.gguf_linear(out, x.contiguous(), weight.type_id, weight.blocks,
                                None if bias is None else bias.float())
            return out
        out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
        kernels.gguf_linear(out, x.float().contiguous(), weight.type_id, weight.blocks,
                            None if bias is None else bias.float())
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def gguf_repack(self, raw: torch.Tensor, qtype: str) -> torch.Tensor | None:
        """K-quant super-blocks into their records through csrc/gguf.cpp (the numpy reference's bytes)."""
        from model_registry.layers.quantization.gguf import GGUF_GROUP, GGUF_RECORD, GGUF_TYPE_IDS, KQUANTS
        from model_registry.layers.quantization.kquants import BLOCK_BYTES

        if not self.fused or qtype not in KQUANTS:
            return None
        out = torch.zeros(-(-raw.shape[0] // GGUF_GROUP), raw.shape[1] // BLOCK_BYTES[qtype] * GGUF_RECORD[qtype],
                          dtype=torch.uint8)
        kernels.gguf_repack_kquant(out, raw.contiguous(), GGUF_TYPE_IDS[qtype])
        return out

    def gguf_embedding(self, input_ids: torch.Tensor, weight, dtype: torch.dtype) -> torch.Tensor:
        """An embedding's rows from its GGUF blocks through csrc/gguf.cpp (each row alone, no float table)."""
        if not (self.fused and input_ids.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)):
            return super().gguf_embedding(input_ids, weight, dtype)
        out = torch.empty(input_ids.numel(), weight.shape[1], dtype=dtype)
        kernels.gguf_rows(out, input_ids.reshape(-1).long().contiguous(), weight.type_id, weight.blocks)
        return out.view(*input_ids.shape, -1)

    def fused_moe(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, state: dict | None = None) -> torch.Tensor:
        """Where ``linear`` runs on the AVX2 GEMM's panels, the whole layer in one C++ call (``moe_one_call``),
        elsewhere expert by expert in Python (``moe_grouped``). Either way an expert no token chose is never
        read."""
        if not (self._rows_ok(x) and x.dtype == w13.dtype == w2.dtype and x.dtype in _KERNEL_DTYPES
                and topk_ids.dim() == 2 and w13.is_contiguous() and w2.is_contiguous()):
            return super().fused_moe(x, w13, w2, topk_weights, topk_ids, state)
        state = {} if state is None else state
        if self.moe_one_call_on and (x.dtype == torch.float32 or self.widen_16bit) and x.dtype in self._panel_dtypes:
            return self.moe_one_call(x, w13, w2, topk_weights, topk_ids, state)
        return self.moe_grouped(x, w13, w2, topk_weights, topk_ids, state)

    def moe_grouped(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, state: dict) -> torch.Tensor:
        """``fused_moe`` in Python on ``linear``'s kernels (inputs checked by it): tokens grouped by expert (one
        stable sort of the T x k choices), then for each expert that received tokens, and only for those, its
        two GEMMs over its own rows (the bf16 GEMM's panels, small_linear at a few rows; each expert's packing
        cached in ``state``), SiLU-and-mul between. The rows go back to their (token, slot) places and the
        routing weights scale and sum them in one product."""
        t, k = topk_ids.shape
        if t == 1:  # a decode row: its k experts one after the other, no grouping (fewer ops per layer)
            out = None
            for j, e in enumerate(topk_ids[0].tolist()):
                h = self.silu_and_mul(self.linear(x, w13[e], None, state.setdefault(("w13", e), {})))
                y = self.linear(h, w2[e], None, state.setdefault(("w2", e), {})) * topk_weights[0, j].to(x.dtype)
                out = y if out is None else out.add_(y)
            return out
        order = torch.argsort(topk_ids.reshape(-1), stable=True)
        counts = torch.bincount(topk_ids.reshape(-1), minlength=w13.shape[0]).tolist()
        grouped = x.index_select(0, order // k)  # the rows of each expert's tokens, expert by expert
        ys = torch.empty(t * k, w2.shape[1], dtype=x.dtype)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = slice(start, start + n)
            h = self.silu_and_mul(self.linear(grouped[rows], w13[e], None, state.setdefault(("w13", e), {})))
            ys[rows] = self.linear(h, w2[e], None, state.setdefault(("w2", e), {}))
            start += n
        back = torch.empty_like(ys)
        back[order] = ys  # row t * k + j: token t's j-th expert
        return torch.bmm(topk_weights.to(x.dtype).unsqueeze(1), back.view(t, k, -1)).squeeze(1)

    def moe_one_call(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, state: dict) -> torch.Tensor:
        """``fused_moe`` in one C++ call (``csrc/moe.cpp``; inputs checked by it, AVX2 GEMM built, x float32 or
        16-bit panels). Why: ``moe_grouped`` is ~15 torch calls per layer at a decode row, whose dispatch cost
        about as much as the two experts' GEMMs at hidden 512 (benchmarks/moe_op.py). The experts' panels live
        in two stacked buffers made here (``torch.empty``: an expert's pages are written only when the kernel
        packs it, the first time a token chooses it), remade with ``ready`` cleared when a weight changes (an
        in-place load bumps its version)."""
        key = (_identity(w13), _identity(w2))
        if state.get("moe_key") != key:
            e, i2, h = w13.shape
            state["moe_p13"] = torch.empty(e, -(-i2 // 16), h, 16, dtype=w13.dtype)
            state["moe_p2"] = torch.empty(e, -(-h // 16), w2.shape[2], 16, dtype=w2.dtype)
            state["moe_ready"] = torch.zeros(e, dtype=torch.uint8)
            state["moe_key"] = key
        out = torch.empty(x.shape, dtype=x.dtype)
        kernels.moe_experts(out, x.contiguous(), topk_ids, topk_weights, w13, w2, state["moe_p13"], state["moe_p2"],
                            state["moe_ready"])
        return out

    def quant_linear(self, x: torch.Tensor, weight, bias: torch.Tensor | None, state: dict) -> torch.Tensor:
        """Pre-quantized weights (``model_registry.layers.quantization.quant_weight.QuantWeight``): 4-bit
        weight-only ones (compressed-tensors W4A16, GPTQ, AWQ) through csrc/wna16.cpp's int4 GEMMs, float8 ones
        through ``fp8_linear``; every other layout dequantised per call (the reference). Half-precision
        activations (a bf16 / fp16 model) are quantized to int8 per row for int4 x int8 dot products
        (``int4_linear_q8``, as llama.cpp's Q4 x Q8: 2.5-10x the float kernel's speed at batch 1 on an AVX2 host,
        ``benchmarks/quant_linear.py --only w4a16``), an activation rounding of amax / 254 per row, as coarse as
        bf16's own for the row's largest values; a float32 model keeps float activations (the checkpoint producer's
        arithmetic, to float32 rounding)."""
        if not (self.fused and x.dim() == 2 and x.device.type == "cpu" and not torch.is_grad_enabled()
                and kernels.available()):
            return super().quant_linear(x, weight, bias, state)
        route = quant_route(x.dtype, weight)
        if route == "fp8":
            return self.fp8_linear(x, weight, bias)
        if route is None:
            return super().quant_linear(x, weight, bias, state)
        h = x.float()
        if weight.perm is not None:
            h = h[:, weight.perm]
        out = torch.empty(x.shape[0], weight.rows, dtype=torch.float32)
        if route == "int4_q8":
            kernels.int4_linear_q8(out, h.contiguous(), weight.codes, weight.scales, weight.zeros, weight.zero,
                                   weight.group)
        else:
            kernels.int4_linear(out, h.contiguous(), weight.codes, weight.scales, weight.zeros, weight.zero,
                                weight.group)
        if bias is not None:
            out += bias.float()
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def fp8_linear(self, x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None) -> torch.Tensor:
        """A float8 e4m3 ``QuantWeight`` through csrc/fp8_linear.cpp: the codes widened to float in registers on
        their way to the FMAs (half of bf16's bytes streamed per decode step, no dequantised copy), the scales
        (per tensor, channel or 128-column block) applied per group. Activations are quantized first as the
        checkpoint says (fp8 per token, per token and group, or static: in the kernel, rounded as ``fake_quant``
        rounds; int8 ones by ``fake_quant`` itself), so the product is the reference's arithmetic up to the order of
        float32 sums."""
        h = x.float()
        if weight.perm is not None:
            h = h[:, weight.perm]
        act = fp8_act_args(weight)
        if act is None:  # int8 activations on fp8 weights: quantized in torch
            assert weight.act is not None
            h, act = fake_quant(h, weight.act), (0, 0, 0.0)
        out = torch.empty(x.shape[0], weight.rows, dtype=torch.float32)
        kernels.fp8_linear_act(out, h.contiguous(), weight.codes, weight.scales, weight.group, *act)
        if bias is not None:
            out += bias.float()
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """One pass of C++ over each row (``csrc/pointwise.cpp``), bf16 logits read as they are: torch's argmax
        costs ~1.3 ms of a batch-64 step over SmolLM2's vocabulary, after a float32 copy."""
        if not (self._rows_ok(x) and x.dtype in _ARGMAX_DTYPES and 0 < x.shape[1] < 1 << 24):
            return super().argmax_rows(x)
        out = torch.empty(x.shape[0], dtype=torch.int64)
        kernels.argmax_rows(out, x)
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not (self._rows_ok(x) and weight.dtype == x.dtype):
            return super().rms_norm(x, weight, eps)
        out = torch.empty_like(x)
        kernels.rms_norm(out, x, weight, eps)
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if not (self._rows_ok(x) and residual.is_cpu and x.shape == residual.shape and residual.stride(1) == 1
                and x.dtype == residual.dtype == weight.dtype):
            return super().add_rms_norm(x, residual, weight, eps)
        kernels.add_rms_norm(x, residual, weight, eps)  # residual += x; x = norm(residual)
        return x, residual

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if not (self._rows_ok(x) and x.shape[1] % 2 == 0):
            return super().silu_and_mul(x)
        out = x.new_empty(x.shape[0], x.shape[1] // 2)
        kernels.silu_and_mul(out, x)
        return out

    def rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not (self.fused and q.is_cpu and q.dim() == 3 and k.dim() == 3 and q.stride(2) == 1
                and k.stride(2) == 1 and cos.dim() == 2 and cos.stride(1) == 1 and sin.stride() == cos.stride()
                and q.dtype == k.dtype == cos.dtype == sin.dtype and not torch.is_grad_enabled()):
            return super().rotary(q, k, cos, sin)
        kernels.rotary(q, k, cos, sin)
        return q, k

    def lora_add(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 ranks: list[int], mapping: LoRAMapping) -> torch.Tensor:
        """Every slot's shrink and expand in one C++ call (``csrc/lora.cpp``) instead of ~10 torch ops. It reads
        the mapping's host lists, so a graph's static mapping goes to the torch default (which refuses it)."""
        if not (not mapping.static and self._rows_ok(x) and self._rows_ok(y)
                and x.dtype == y.dtype == lora_a.dtype == lora_b.dtype
                and x.dtype in _KERNEL_DTYPES and lora_a.is_contiguous() and lora_b.is_contiguous()):
            return super().lora_add(y, x, lora_a, lora_b, ranks, mapping)
        kernels.lora_add(y, x, lora_a, lora_b, mapping.order, mapping.slots, mapping.starts, ranks)
        return y

    def _rows_ok(self, x: torch.Tensor) -> bool:
        # Cheapest checks first (``is_cpu`` is a flag, ``device.type`` builds a device object): they run
        # several times per layer of every step.
        return self.fused and x.is_cpu and x.dim() == 2 and x.stride(1) == 1 and not torch.is_grad_enabled()


def quant_route(dt: torch.dtype, weight: QuantWeight) -> str | None:
    """The C++ kernel ``CpuModelOps.quant_linear`` computes a pre-quantized weight with for activations of dtype ``dt``
    ("fp8": fp8_linear_act, "int4_q8": int4_linear_q8, "int4": int4_linear), or None (dequantised per call):
    shared with the one-call decoder layer (decoder_layer.py), which takes the same kernels."""
    if weight.is_float and weight.zeros is None and not weight.zero:
        return "fp8"
    if not (weight.bits == 4 and weight.act is None and not weight.is_float and weight.group % 2 == 0
            and weight.cols % weight.group == 0):
        return None
    return "int4_q8" if dt != torch.float32 and weight.group % 32 == 0 and weight.cols % 64 == 0 else "int4"


def fp8_act_args(weight: QuantWeight) -> tuple[int, int, float] | None:
    """``fp8_linear_act``'s (mode, group, static scale) for a float8 weight's activation quantization, or None where
    the kernel does not round them (int8 activations; a group not dividing the input features)."""
    act = weight.act
    if act is None:
        return 0, 0, 0.0
    if act.kind != "fp8":
        return None
    if act.strategy == "token":
        return 1, 0, 0.0
    if act.strategy == "group":
        return (2, int(act.group), 0.0) if act.group and weight.cols % act.group == 0 else None
    assert act.scale is not None
    return 3, 0, float(act.scale.float())
