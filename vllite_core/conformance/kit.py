"""Reusable pieces of the conformance kit: attention cases, a tiny model, a step driver.

Everything random is drawn on the CPU from fixed seeds and then moved to the
device, so every platform sees the same numbers. Backends are driven only
through the ``AttentionBackend`` API (``get_kv_cache_shape``, ``prepare``,
``forward``), never by reading their cache, so a platform is free to lay its
KV cache out as it likes.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vllite_core.attention.backend import AttentionBackend
from vllite_core.attention.reference import build_metadata, reference_paged_attention
from vllite_core.utils import cdiv

# ---------------------------------------------------------------------------------------------
# Attention against the reference
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionCase:
    """One step: request i adds ``query_lens[i]`` tokens to ``context_lens[i]`` already cached ones."""

    name: str
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    num_heads: int = 4
    num_kv_heads: int = 4
    head_size: int = 32
    sliding_window: int | None = None
    padding_rows: int = 0  # extra query rows after the real ones, slot -1 (what a padded graph batch sends)
    logits_soft_cap: float | None = None  # Gemma 2's cap * tanh(score / cap)
    # Several layers on the same step's metadata, each with its own window (Gemma's alternating local and global
    # layers): the step's forward runs once per window; None: just ``sliding_window``.
    layer_windows: tuple[int | None, ...] | None = None

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return tuple(q + c for q, c in zip(self.query_lens, self.context_lens))


STANDARD_CASES: tuple[AttentionCase, ...] = (
    AttentionCase("prefill", (5, 17, 3), (0, 0, 0)),
    AttentionCase("decode", (1, 1, 1, 1), (0, 5, 16, 40)),
    AttentionCase("chunked-prefill-partial-blocks", (3, 6, 2), (6, 7, 5)),
    AttentionCase("mixed-gqa", (1, 7, 1, 4, 1), (10, 0, 1, 6, 4), num_heads=8, num_kv_heads=2),
    AttentionCase("gqa-one-kv-head", (1, 1, 6), (29, 2, 0), num_heads=6, num_kv_heads=1),
    AttentionCase("long-decode-gqa", (1, 1), (70, 33), num_heads=8, num_kv_heads=2, head_size=64),
    AttentionCase("long-chunks-gqa", (40, 1, 25), (30, 50, 0), num_heads=8, num_kv_heads=2),
    AttentionCase("sliding-window", (1, 6, 1, 5), (11, 0, 3, 9), num_heads=4, num_kv_heads=2, sliding_window=3),
    AttentionCase("padded-decode-batch", (1, 1, 1), (4, 9, 2), padding_rows=2),
    AttentionCase("soft-cap", (1, 7, 1, 20), (10, 0, 37, 5), num_heads=8, num_kv_heads=2, logits_soft_cap=1.5),
    AttentionCase("per-layer-windows-soft-cap", (1, 6, 1, 18), (21, 0, 3, 9), num_heads=4, num_kv_heads=2,
                  logits_soft_cap=2.0, layer_windows=(4, None, 7)),
)


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) for comparing a backend's output with the float32 reference."""
    if dtype == torch.float32:
        return 1e-4, 1e-4
    if dtype == torch.float16:
        return 1e-2, 1e-2
    return 3e-2, 3e-2  # bfloat16 and anything coarser


@dataclass
class AttentionResult:
    step: str
    out: torch.Tensor  # backend output (CPU float32), real rows only
    ref: torch.Tensor  # reference output (CPU float32)
    again: torch.Tensor  # backend output of a second forward on the same step (the next layer's view)


def run_attention_case(backend: AttentionBackend, case: AttentionCase, device: torch.device | str,
                       dtype: torch.dtype = torch.float32, cache_dtype: torch.dtype | None = None,
                       block_size: int = 16, num_blocks: int = 48, seed: int = 0, repeat: bool = True,
                       write_context: Callable[..., None] | None = None) -> list[AttentionResult]:
    """Run ``case`` on ``backend`` and on the reference; returns one result per step.

    Step 1 prefills every request's cached context (written by the backend itself, so the cache layout
    stays the backend's business); step 2 is the case's own step. Blocks are random, non-contiguous
    and never block 0 (the engine's null block). ``repeat`` runs each step's forward a second time, as the
    next layer would. ``write_context(key, value, cache, slot_mapping)``, when given, stores the context
    instead of a step-1 forward (a backend's own tests can save time; step 1 is then not compared)."""
    device = torch.device(device)
    cache_dtype = cache_dtype or dtype
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(cdiv(s, block_size))] for s in case.seq_lens]
    h, hkv, d = case.num_heads, case.num_kv_heads, case.head_size
    cache = torch.zeros(backend.get_kv_cache_shape(num_blocks, block_size, hkv, d), dtype=cache_dtype, device=device)
    ref_cache = torch.zeros(2, num_blocks, block_size, hkv, d, dtype=cache_dtype)
    scale = d ** -0.5
    steps: list[tuple[str, list[int], list[int], list[list[int]], int]] = []
    first = [i for i, c in enumerate(case.context_lens) if c > 0]
    if first:
        steps.append(("context", [case.context_lens[i] for i in first], [case.context_lens[i] for i in first],
                      [tables[i] for i in first], 0))
    steps.append((case.name, list(case.query_lens), list(case.seq_lens), tables, case.padding_rows))
    results = []
    for step, q_lens, s_lens, tbls, pad in steps:
        md = build_metadata(q_lens, s_lens, tbls, block_size)
        n = md.num_actual_tokens
        q = torch.randn(n + pad, h, d, generator=gen).to(dtype)
        k = torch.randn(n + pad, hkv, d, generator=gen).to(dtype)
        v = torch.randn(n + pad, hkv, d, generator=gen).to(dtype)
        if pad:
            md.slot_mapping = torch.cat([md.slot_mapping, torch.full((pad,), -1, dtype=torch.int64)])
        dmd = build_metadata(q_lens, s_lens, tbls, block_size, device=device)
        dmd.slot_mapping = md.slot_mapping.to(device)
        qd, kd, vd = q.to(device), k.to(device), v.to(device)
        if step == "context" and write_context is not None:
            reference_paged_attention(q[:n], k[:n], v[:n], ref_cache, md, scale)  # the reference's cache too
            write_context(kd, vd, cache, dmd.slot_mapping)
            continue
        backend.prepare(dmd)
        cap = case.logits_soft_cap
        extra = {"logits_soft_cap": cap} if cap else {}  # a backend without soft-capping never sees it
        windows = case.layer_windows or (case.sliding_window,)
        for window in windows:  # one layer per window, the step's metadata shared
            ref = reference_paged_attention(q[:n], k[:n], v[:n], ref_cache, md, scale, window, cap)
            out = backend.forward(qd, kd, vd, cache, dmd, scale, window, **extra)
            again = backend.forward(qd, kd, vd, cache, dmd, scale, window, **extra) if repeat else out
            if tuple(out.shape) != tuple(qd.shape):
                raise AssertionError(f"{step}: backend returned shape {tuple(out.shape)}, expected {tuple(qd.shape)}")
            if out.dtype != dtype:
                raise AssertionError(f"{step}: backend returned {out.dtype}, expected the query dtype {dtype}")
            name = step if len(windows) == 1 else f"{step} (window {window})"
            results.append(AttentionResult(name, out[:n].float().cpu(), ref.float(), again[:n].float().cpu()))
    return results


def assert_attention_matches(results: Sequence[AttentionResult], dtype: torch.dtype) -> None:
    atol, rtol = tolerance(dtype)
    for r in results:
        torch.testing.assert_close(r.out, r.ref, atol=atol, rtol=rtol, msg=lambda m: f"step {r.step!r}: {m}")
        torch.testing.assert_close(r.again, r.out, atol=atol, rtol=rtol,
                                   msg=lambda m: f"step {r.step!r}, second forward (next layer): {m}")


# ---------------------------------------------------------------------------------------------
# Fused mixture-of-experts against a float64 per-token loop
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoeCase:
    """``tokens`` tokens each routed to ``top_k`` distinct experts of ``num_experts``; ``routing``: "uneven" (a
    skewed spread) or "one-expert" (expert 0 in every token's first slot). The last ``unused`` experts are never
    chosen and hold NaN: an op that reads them fails."""

    name: str
    tokens: int
    top_k: int
    routing: str = "uneven"
    num_experts: int = 8
    unused: int = 2
    hidden: int = 64
    intermediate: int = 48


MOE_CASES: tuple[MoeCase, ...] = (
    MoeCase("decode-one-token", 1, 2),
    MoeCase("uneven-prefill", 41, 2),
    MoeCase("top3-small-batch", 5, 3),
    MoeCase("one-expert-takes-all", 17, 1, routing="one-expert"),
    MoeCase("one-expert-first-slot-top2", 12, 2, routing="one-expert"),
)


def moe_case_inputs(case: MoeCase, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """(x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k], topk_ids [T, k]) in float32 on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    used = case.num_experts - case.unused
    x = torch.randn(case.tokens, case.hidden, generator=gen)
    w13 = torch.randn(case.num_experts, 2 * case.intermediate, case.hidden, generator=gen) * 0.15
    w2 = torch.randn(case.num_experts, case.hidden, case.intermediate, generator=gen) * 0.15
    w13[used:], w2[used:] = float("nan"), float("nan")
    ids = torch.stack([torch.randperm(used, generator=gen)[:case.top_k] for _ in range(case.tokens)])
    if case.routing == "one-expert":
        ids[ids == 0] = ids[:, 0:1].expand_as(ids)[ids == 0]  # keep ids distinct after moving 0 first
        ids[:, 0] = 0
    else:
        ids[: case.tokens // 2, 0] = torch.where((ids[: case.tokens // 2, 1:] == 1).any(1),
                                                 ids[: case.tokens // 2, 0], 1)  # expert 1 takes many
    weights = torch.rand(case.tokens, case.top_k, generator=gen)
    return x, w13, w2, weights, ids


def moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor) -> torch.Tensor:
    """Each token through each of its experts in float64, one at a time, weighted and summed."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e].double() @ x[t].double()).chunk(2)
            out[t] += float(weights[t, j]) * (w2[e].double() @ (torch.nn.functional.silu(gate) * up))
    return out


def run_moe_case(ops: Any, case: MoeCase, device: torch.device | str, dtype: torch.dtype,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The platform op's output (CPU float32) and the float64 reference (float32) for ``case``: inputs rounded
    to ``dtype`` first, so both see the same numbers. The op runs twice (its cached state reused); the runs
    must agree."""
    inputs = moe_case_inputs(case, seed)
    ids = inputs[-1]
    x, w13, w2, weights = (t.to(dtype) for t in inputs[:-1])
    ref = moe_reference(x, w13, w2, weights, ids).float()
    state: dict = {}
    with torch.inference_mode():
        dev = [t.to(device) for t in (x, w13, w2, weights, ids)]
        out = ops.fused_moe(*dev, state)
        again = ops.fused_moe(*dev, state)
    if tuple(out.shape) != tuple(x.shape) or out.dtype != dtype:
        raise AssertionError(f"{case.name}: fused_moe returned {tuple(out.shape)} {out.dtype}, expected "
                             f"{tuple(x.shape)} {dtype}")
    if not torch.equal(out, again):
        raise AssertionError(f"{case.name}: a second call with the same state gave other numbers")
    return out.float().cpu(), ref


# ---------------------------------------------------------------------------------------------
# A tiny random Llama
# ---------------------------------------------------------------------------------------------

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)


def tiny_llama_config(**overrides: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**{**TINY, **overrides}, architectures=["LlamaForCausalLM"])


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random weights, scaled so greedy choices are not near-ties; drawn on the CPU in name order."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if name.endswith("norm.weight"):
            w = torch.rand(p.shape, generator=gen) + 0.5
        else:
            w = torch.randn(p.shape, generator=gen) * 0.15
        p.copy_(w.to(p.dtype))
    return model


def make_tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer over ``t0 .. t{n-3}``, ``<unk>`` and ``</s>`` (no download, no model file)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size - 2)}
    vocab["<unk>"], vocab["</s>"] = vocab_size - 2, vocab_size - 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")


def save_tiny_llama(path: str, seed: int = 0, **overrides: Any) -> Any:
    """A random-weight HF Llama checkpoint (float32) and a tokenizer in ``path``; returns the HF model."""
    from transformers import AutoModelForCausalLM

    config = tiny_llama_config(**overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, seed)
    model.save_pretrained(path)
    make_tokenizer(config.vocab_size).save_pretrained(path)
    return model.eval()


@torch.inference_mode()
def hf_greedy(model: Any, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens from transformers' own forward and cache (the reference)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated", category=FutureWarning)
        out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
        past, tokens = out.past_key_values, []
        nxt = int(out.logits[0, -1].argmax())
        while True:
            tokens.append(nxt)
            if len(tokens) == max_new_tokens:
                return tokens
            out = model(input_ids=torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
            past, nxt = out.past_key_values, int(out.logits[0, -1].argmax())


def build_engine_model(backend: AttentionBackend, dtype: torch.dtype, device: torch.device | str,
                       seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """The engine's own Llama on ``device`` with random weights (no checkpoint)."""
    from model_registry.models.llama import LlamaForCausalLM

    cpu_model = LlamaForCausalLM(tiny_llama_config(**overrides), backend, torch.float32)
    randomize_(cpu_model, seed)
    model = cpu_model.to(device=device, dtype=dtype).eval()
    model.ensure_positions(TINY["max_position_embeddings"])
    return model


def run_model(model: Any, inputs: dict[str, Any]) -> torch.Tensor:
    """One engine-model forward from a ``{input_ids, positions, kv_caches, metadata}`` dict (one cache group:
    every layer reads the same metadata)."""
    caches = inputs["kv_caches"]
    return model(inputs["input_ids"], inputs["positions"], caches, [inputs["metadata"]] * len(caches))


@dataclass
class _Req:
    tokens: list[int]
    computed: int = 0
    blocks: list[int] = field(default_factory=list)


class StepDriver:
    """Runs an engine model step by step over a paged cache on a device (no scheduler, no sampler)."""

    def __init__(self, model: Any, backend: AttentionBackend, device: torch.device | str, cache_dtype: torch.dtype,
                 num_blocks: int = 64, block_size: int = 16, seed: int = 0) -> None:
        self.model, self.backend, self.block_size = model, backend, block_size
        self.device = torch.device(device)
        shape = backend.get_kv_cache_shape(num_blocks, block_size, model.num_kv_heads, model.head_size)
        self.kv_caches = [torch.zeros(shape, dtype=cache_dtype, device=self.device) for _ in range(model.num_layers)]
        self.free = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free)
        self.reqs: dict[str, _Req] = {}
        self.max_blocks = TINY["max_position_embeddings"] // block_size

    def add(self, rid: str, prompt: list[int]) -> None:
        self.reqs[rid] = _Req(list(prompt))

    def inputs(self, schedule: dict[str, int]) -> dict[str, Any]:
        """``{input_ids, positions, kv_caches, metadata}`` for ``{request: num_new_tokens}`` (allocates blocks)."""
        ids, pos, q_lens, s_lens, tables = [], [], [], [], []
        for rid, n in schedule.items():
            r = self.reqs[rid]
            end = r.computed + n
            while len(r.blocks) * self.block_size < end:
                r.blocks.append(self.free.pop())
            ids += r.tokens[r.computed:end]
            pos += list(range(r.computed, end))
            q_lens.append(n)
            s_lens.append(end)
            tables.append(r.blocks)
        md = build_metadata(q_lens, s_lens, tables, self.block_size, device=self.device)
        self.backend.prepare(md)
        return {"input_ids": torch.tensor(ids, device=self.device), "positions": torch.tensor(pos, device=self.device),
                "kv_caches": self.kv_caches, "metadata": md}

    def advance(self, schedule: dict[str, int]) -> None:
        for rid, n in schedule.items():
            self.reqs[rid].computed += n

    @torch.inference_mode()
    def step(self, schedule: dict[str, int]) -> torch.Tensor:
        """Eager step; float32 logits of every scheduled token ([T, vocab], on the CPU)."""
        inp = self.inputs(schedule)
        hidden = run_model(self.model, inp)
        self.advance(schedule)
        return self.model.compute_logits(hidden).float().cpu()

    def append_greedy(self, rid: str, logits_row: torch.Tensor) -> None:
        self.reqs[rid].tokens.append(int(logits_row.argmax()))
