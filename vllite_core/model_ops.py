"""The pointwise pieces of a transformer layer (and the sampler's argmax), as one object a platform may replace.

Models call ``current_model_ops()`` when they build their layers and keep what it returns; the
worker builds the model inside ``use_model_ops(platform.model_ops(config))``. The defaults here are
plain torch, written in the order transformers computes them (the numerics models are tested
against); a platform returns a subclass that fuses them (the CPU platform's C++ kernels), and falls
back to these for anything its kernels do not cover. Outside a worker (a model built by hand in a
test) the defaults apply.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from vllite_core.attention.encoder import PackedPrompts, padded_attention

if TYPE_CHECKING:
    from model_registry.layers.fast_path import DecoderLayerRecord
    from model_registry.layers.quantization.gguf import GGUFWeight
    from model_registry.layers.quantization.quant_weight import QuantWeight
    from vllite_core.lora.mapping import LoRAMapping

INT8_MAX = 127.0


def quantize_rows_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values, float32 scale per row) with ``w[i] ~= q[i] * scale[i]``: symmetric, ``scale = max|w_row| /
    127``, round half to even; an all-zero row gets scale 1. The int8 weights' layout and the reference of the
    activations' quantization in ``int8_linear`` (a platform's kernel rounds the same way)."""
    w = w.float()
    amax = w.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


class ModelOps:
    """Torch reference implementations; every method returns new tensors or documents what it mutates."""

    name = "torch"
    # lora_add reads the step's LoRAMapping from its device tensors only (a captured graph may replay it).
    lora_graph_safe = False

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               state: dict) -> torch.Tensor:
        """``x @ weight.T + bias``. ``state`` is a per-layer dict a platform may cache a repacked weight in."""
        return F.linear(x, weight, bias)

    def decoder_layer(self, record: DecoderLayerRecord | str
                      ) -> Callable[..., tuple[torch.Tensor, torch.Tensor] | None] | None:
        """A platform's whole-layer path for a pre-norm decoder layer known by its typed record
        (``model_registry.layers.fast_path.DecoderLayerRecord``; a string: the model's reason it has none): a
        callable ``(rope, x, residual, kv_cache, metadata)`` that returns what the layer's ``forward`` returns,
        bit for bit, or None for a call it does not take (the layer then runs its own code). A platform that
        never takes a record says why, once, in the log. None here: no such path, every layer runs its
        modules."""
        return None

    def decoder_stack(self, layers: list[torch.nn.Module]
                      ) -> Callable[..., tuple[torch.Tensor, torch.Tensor] | None] | None:
        """A platform's path for all of a model's Llama-style decoder layers at once (each as ``decoder_layer``
        describes): a callable ``(rope, x, kv_caches, metadata)`` that returns what running the layers in turn
        from the embedding (no residual yet) returns, bit for bit, or None for a call it does not take (the
        layers then run one by one). None here: no such path."""
        return None

    def int8_linear(self, x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None, state: dict) -> torch.Tensor:
        """W8A8 linear (``model_registry.layers.quantization.int8``): ``x`` quantized per row like the weight, the int8
        products summed, scaled by both scales, ``bias`` added, in ``x``'s dtype. Here in float64, where
        every int8 sum of a layer this size is exact: a reference, not a fast path."""
        xq, xs = quantize_rows_int8(x)
        acc = xq.double() @ qweight.double().T
        y = (acc * xs.double()[:, None] * weight_scale.double()[None, :]).float()
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)

    def gguf_linear(self, x: torch.Tensor, weight: GGUFWeight, bias: torch.Tensor | None, state: dict) -> torch.Tensor:
        """``x @ W.T + bias`` with W a ``model_registry.layers.quantization.gguf.GGUFWeight`` (GGUF blocks). Here
        the blocks are dequantised on every call and multiplied in float32 (the exact weights; slow, a
        reference): a platform's kernel computes from the blocks."""
        y = F.linear(x.float(), weight.dequantize(), None if bias is None else bias.float())
        return y.to(x.dtype)

    def gguf_repack(self, raw: torch.Tensor, qtype: str) -> torch.Tensor | None:
        """GGUF blocks ``raw`` (uint8 [N, block bytes per row] of type ``qtype``) in ``GGUFWeight.blocks``' layout,
        made at load by a platform's kernel; None: the reference repack (numpy) makes it."""
        return None

    def gguf_embedding(self, input_ids: torch.Tensor, weight: GGUFWeight, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``input_ids`` of the table W given by its GGUF blocks (an embedding kept as blocks), in ``dtype``:
        the dequantised load's values. Here the groups of 8 rows holding them are dequantised (a reference); a
        platform's kernel reads the rows alone."""
        flat = input_ids.reshape(-1)
        groups = torch.unique(flat // 8)
        rows = dataclasses.replace(weight, blocks=weight.blocks[groups], rows=8 * len(groups)).dequantize()
        at = torch.searchsorted(groups, flat // 8) * 8 + flat % 8
        return rows[at].to(dtype).view(*input_ids.shape, -1)

    def quant_linear(self, x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None,
                     state: dict) -> torch.Tensor:
        """``x @ W.T + bias`` with W a pre-quantized checkpoint's weight
        (``model_registry.layers.quantization.quant_weight.QuantWeight``: int4/int8/fp8 codes, group-wise scales,
        activations quantized first where the checkpoint says so). Here dequantised on every call and multiplied
        in float32 (a reference, and the fallback of platforms without a kernel for the layout)."""
        return weight.reference(x, bias)

    def linear_gelu(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    state: dict) -> torch.Tensor:
        """``gelu(x @ weight.T + bias)`` with torch's exact (erf) GELU: an encoder's intermediate layer, which a
        platform may fuse into its GEMM (no pass of its own over the widest activation)."""
        return F.gelu(self.linear(x, weight, bias, state))

    def add_layer_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                       eps: float) -> torch.Tensor:
        """``layer_norm(x + residual)`` (post-LN residual blocks); an implementation may reuse ``x``'s storage."""
        return F.layer_norm(x + residual, x.shape[-1:], weight, bias, eps)

    def encoder_attention(self, qkv: torch.Tensor, prompts: PackedPrompts, scale: float) -> torch.Tensor:
        """Bidirectional attention within each prompt of the step: ``qkv`` [T, 3, heads, head_size] (the fused
        projection) -> [T, heads, head_size]. Torch's SDPA over prompts padded into buckets."""
        return padded_attention(qkv, prompts, scale)

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x.argmax(dim=-1)`` of a 2-D tensor (int64): each row's first largest value, a NaN counting as the
        largest. The sampler's, for greedy rows and the random rows' race."""
        return x.argmax(dim=-1)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(residual + x), residual + x)``; an implementation may reuse ``x`` and ``residual``'s storage."""
        residual = residual + x
        return self.rms_norm(residual, weight, eps), residual

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(x[..., :n]) * x[..., n:]`` for ``x`` of last dimension ``2n``."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """NeoX-layout rotary embedding of ``q`` [T, H, D] and ``k`` [T, Hkv, D]; ``cos``/``sin`` are [T, D].
        An implementation may rotate ``q`` and ``k`` in place."""
        cos, sin = cos[:, None, :], sin[:, None, :]
        return rotate_neox(q, cos, sin), rotate_neox(k, cos, sin)

    def lora_add(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 ranks: list[int], mapping: LoRAMapping) -> torch.Tensor:
        """Multi-LoRA: add every adapted row's low-rank update to the base output ``y`` [T, out] in place and
        return it. ``lora_a`` [slots, R, in] and ``lora_b`` [slots, R, out] (B transposed, scaling folded in)
        are the stacked adapters, zero past each slot's rank ``ranks[slot]`` (0: the slot does not adapt this
        layer); ``mapping`` (``vllite_core.lora.mapping``) groups the step's adapted rows by slot. Row t of
        slot s gets ``x[t] @ lora_a[s].T @ lora_b[s]``. Here: one gather, one shrink and one expand per
        active slot on its contiguous segment, one scatter-add."""
        if mapping.static:
            raise RuntimeError("lora_add: a graph's mapping needs an op that reads only its device tensors "
                               "(lora_graph_safe)")
        order, identity = mapping.order, mapping.identity
        xs = x if identity else x.index_select(0, order)
        delta = y.new_empty(xs.shape[0], y.shape[1])
        for slot, start, end in mapping.segments:
            r = ranks[slot]
            if r == 0:
                delta[start:end].zero_()
            else:
                torch.mm(F.linear(xs[start:end], lora_a[slot, :r]), lora_b[slot, :r], out=delta[start:end])
        return y.add_(delta) if identity else y.index_add_(0, order, delta)

    # ---- recurrent layers (Mamba and hybrids) -------------------------------------------------
    # A step's tokens arrive flattened; ``query_start_loc`` (host list, R + 1 entries) splits them into the
    # R requests, and each request's state row (gathered by the caller, zero for a fresh request) comes in
    # and is updated in place, so chunked prefill and decode continue where the last step stopped.

    def causal_conv1d(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      conv_state: torch.Tensor, query_start_loc: list[int], activation: str | None) -> torch.Tensor:
        """Causal depthwise conv over each request's tokens: ``x`` [T, C], ``weight`` [C, K], ``conv_state``
        [R, C, K-1] (the request's last K-1 inputs, updated in place). Returns [T, C]."""
        k = weight.shape[-1]
        if len(query_start_loc) - 1 == x.shape[0]:  # one token per request (decode): all rows at once
            window = torch.cat([conv_state, x[:, :, None]], dim=-1)
            conv_state.copy_(window[:, :, 1:])
            y = (window * weight).sum(-1)
            if bias is not None:
                y = y + bias
            return _activate(y, activation)
        out = torch.empty_like(x)
        for r, (start, end) in enumerate(zip(query_start_loc[:-1], query_start_loc[1:])):
            seq = torch.cat([conv_state[r], x[start:end].t()], dim=-1)  # [C, K-1 + L]
            out[start:end] = F.conv1d(seq[None], weight[:, None, :], bias, groups=weight.shape[0])[0].t()
            conv_state[r].copy_(seq[:, seq.shape[1] - (k - 1):])
        return _activate(out, activation)

    def selective_scan(self, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                       D: torch.Tensor | None, z: torch.Tensor | None, dt_bias: torch.Tensor | None,
                       ssm_state: torch.Tensor, query_start_loc: list[int]) -> torch.Tensor:
        """Mamba-1 selective scan: ``x``, ``dt``, ``z`` [T, Dm], ``A`` [Dm, N], ``B``, ``C`` [T, N],
        ``ssm_state`` [R, Dm, N] (updated in place). h = exp(dt A) h + dt B x; y = C h + D x, gated by silu(z)."""
        if dt_bias is not None:
            dt = dt + dt_bias
        dt = F.softplus(dt).float()
        dA = torch.exp(A.float()[None] * dt[:, :, None])  # [T, Dm, N]
        dBx = dt[:, :, None] * B.float()[:, None, :] * x.float()[:, :, None]
        if len(query_start_loc) - 1 == x.shape[0]:  # decode: one step for every request at once
            h = ssm_state.float() * dA + dBx
            ssm_state.copy_(h)
            y = torch.matmul(h.to(C.dtype), C[:, :, None])[..., 0]
        else:
            y = torch.empty_like(x)
            for r, (start, end) in enumerate(zip(query_start_loc[:-1], query_start_loc[1:])):
                h = ssm_state[r].float()
                for t in range(start, end):
                    h = dA[t] * h + dBx[t]
                    y[t] = torch.matmul(h.to(C.dtype), C[t])
                ssm_state[r].copy_(h)
        if D is not None:
            y = y + x * D
        if z is not None:
            y = y * F.silu(z)
        return y.to(x.dtype)

    def ssd_scan(self, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                 D: torch.Tensor | None, dt_bias: torch.Tensor, dt_limit: tuple[float, float], chunk_size: int,
                 ssm_state: torch.Tensor, query_start_loc: list[int]) -> torch.Tensor:
        """Mamba-2 scan (scalar decay per head): ``x`` [T, H, P], ``dt`` [T, H] (before bias and softplus),
        ``A`` [H], ``B``, ``C`` [T, G, N] (G groups of heads), ``ssm_state`` [R, H, P, N] (updated in place).
        Prefill runs the chunked state-space-duality form (``ssd_chunked``); decode one recurrent step.
        Returns float32 [T, H, P]."""
        dt = F.softplus(dt.float() + dt_bias.float()).clamp(dt_limit[0], dt_limit[1])
        heads, groups = x.shape[1], B.shape[1]
        B = B.float().repeat_interleave(heads // groups, dim=1)  # [T, H, N]
        C = C.float().repeat_interleave(heads // groups, dim=1)
        x32, A = x.float(), A.float()
        if len(query_start_loc) - 1 == x.shape[0]:  # decode: h = exp(dt A) h + dt B x for every request
            dA = torch.exp(dt * A)[:, :, None, None]
            h = ssm_state.float() * dA + (dt[:, :, None] * x32)[..., None] * B[:, :, None, :]
            ssm_state.copy_(h)
            y = torch.matmul(h, C[..., None])[..., 0]
        else:
            y = torch.empty_like(x32)
            for r, (start, end) in enumerate(zip(query_start_loc[:-1], query_start_loc[1:])):
                y[start:end], final = ssd_chunked(x32[start:end], dt[start:end], A, B[start:end], C[start:end],
                                                  chunk_size, ssm_state[r].float())
                ssm_state[r].copy_(final)
        if D is not None:
            y = y + x32 * D.float()[:, None]
        return y


    def fused_moe(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, state: dict | None = None) -> torch.Tensor:
        """Mixture of SwiGLU experts: ``x`` [T, H]; ``w13`` [E, 2I, H] (gate rows, then up) and ``w2`` [E, H, I]
        stacked expert weights; each token goes to its ``topk_ids`` [T, k] experts, their outputs summed with
        ``topk_weights`` [T, k] (routing is the router's: ``model_registry.layers.moe``). Returns [T, H]. Only
        the experts some token chose are computed. ``state``: a per-layer dict a platform may cache repacked
        expert weights in (as ``linear``'s)."""
        return _routed(x, topk_weights, topk_ids,
                       lambda e, xe: F.linear(self.silu_and_mul(F.linear(xe, w13[e])), w2[e]))

    def gguf_fused_moe(self, x: torch.Tensor, experts: Sequence[tuple[Sequence[GGUFWeight], GGUFWeight]],
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """``fused_moe`` with each expert's weights as GGUF blocks (``quantization="gguf"``): ``experts[e]`` is
        (w13 as one or two blocks weights, gate rows then up; w2), each product through ``gguf_linear``."""
        def expert(e: int, xe: torch.Tensor) -> torch.Tensor:
            w13, w2 = experts[e]
            gate_up = torch.cat([self.gguf_linear(xe, w, None, {}) for w in w13], dim=-1)
            return self.gguf_linear(self.silu_and_mul(gate_up), w2, None, {})

        return _routed(x, topk_weights, topk_ids, expert)


def _routed(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
            expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Each chosen expert's ``expert(e, its tokens' rows)`` weighted by the routing and summed into its tokens (only
    the experts some token chose run)."""
    out = torch.zeros_like(x)
    for e in torch.unique(topk_ids).tolist():
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        out.index_add_(0, tok, (expert(e, x[tok]) * topk_weights[tok, slot, None]).to(out.dtype))
    return out


def _activate(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return x
    if activation in ("silu", "swish"):
        return F.silu(x)
    raise NotImplementedError(f"activation {activation!r} after a causal conv1d (silu only)")


def rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin (the HF/NeoX layout: the two halves of each head are paired)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


_current: contextvars.ContextVar[ModelOps | None] = contextvars.ContextVar("vllite_model_ops", default=None)
_DEFAULT = ModelOps()


def current_model_ops() -> ModelOps:
    """The ops for the model being built (the platform's inside ``use_model_ops``, else the torch defaults)."""
    return _current.get() or _DEFAULT


@contextlib.contextmanager
def use_model_ops(ops: ModelOps) -> Iterator[ModelOps]:
    token = _current.set(ops)
    try:
        yield ops
    finally:
        _current.reset(token)


def ssd_chunked(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                chunk_size: int, h0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence through the Mamba-2 recurrence h_t = exp(a_t) h_{t-1} + dt_t B_t x_t, y_t = C_t h_t with
    a_t = dt_t A, in chunks of ``chunk_size``: inside a chunk it is a masked, decay-weighted C.B product
    (matmuls); across chunks the state is carried by one decay per chunk. ``x`` [L, H, P], ``dt`` [L, H],
    ``B``, ``C`` [L, H, N], ``h0`` [H, P, N]. Returns (y [L, H, P], final state [H, P, N])."""
    length = x.shape[0]
    pad = (-length) % chunk_size
    if pad:
        x, dt, B, C = (F.pad(t, (0,) * (2 * t.dim() - 2) + (0, pad)) for t in (x, dt, B, C))
    nc = x.shape[0] // chunk_size
    xs = (x * dt[..., None]).view(nc, chunk_size, *x.shape[1:])  # dt x: [c, l, H, P]
    a = (dt * A).view(nc, chunk_size, -1)  # [c, l, H]
    B, C = B.view(nc, chunk_size, *B.shape[1:]), C.view(nc, chunk_size, *C.shape[1:])
    cum = torch.cumsum(a, dim=1)  # [c, l, H]: decay from the chunk start to l (inclusive)
    # Intra-chunk: y[l] = sum_{s <= l} exp(cum[l] - cum[s]) (C[l] . B[s]) dt[s] x[s].
    causal = torch.tril(torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device))
    diff = cum[:, :, None, :] - cum[:, None, :, :]  # [c, l, s, H]
    decay = torch.exp(diff.masked_fill(~causal[None, :, :, None], float("-inf")))
    scores = torch.einsum("clhn,cshn->clsh", C, B) * decay
    y = torch.einsum("clsh,cshp->clhp", scores, xs)
    # Each chunk's own contribution to the state at its end, then the carried state chunk by chunk.
    to_end = torch.exp(cum[:, -1:, :] - cum)  # [c, l, H]
    chunk_states = torch.einsum("clhn,clh,clhp->chpn", B, to_end, xs)
    chunk_decay = torch.exp(cum[:, -1, :])  # [c, H]
    h = h0
    starts = []
    for c in range(nc):
        starts.append(h)
        h = chunk_decay[c][:, None, None] * h + chunk_states[c]
    start_states = torch.stack(starts)  # [c, H, P, N]: the state entering each chunk
    y = y + torch.einsum("clhn,chpn->clhp", C, start_states) * torch.exp(cum)[..., None]
    # The padded tail (dt = 0: no decay, no input) leaves the final state as it was.
    return y.reshape(nc * chunk_size, *x.shape[1:])[:length], h
