"""A mixture of experts' speed, as ratios measured side by side in one run (issue 54's proof):

1. batch-1 decode: the MoE's time per token should follow its *active* parameters (top-k experts' worth of FFN),
   not its total. Three random-weight checkpoints from transformers configs, same width, layers, attention and
   vocabulary: a Mixtral with ``--experts`` experts of ``--expert-inter`` (top ``--top-k``), a Llama whose FFN is
   the active size (``top_k * expert_inter``) and a Llama whose FFN is the total (``experts * expert_inter``).
   All three engines (``LLM``, current platform) are loaded at once and each first decodes ``--warmup-tokens``
   untimed (the CPU op packs an expert's weights into its kernel's panels the first time a decode row picks it,
   once per expert: without the warm-up the timed steps pay for it), then each prefills one request and their
   decode steps take turns (MoE, dense active, dense total, MoE, ...), each step timed alone, so the host's
   drifting load hits all three alike. Fastest and median step reported, and their ratios. ``--with-grouped``
   adds a fourth engine, the same MoE with ``VLLITE_CPU_MOE_ONE_CALL=0`` (the CPU op expert by expert in Python
   instead of one C++ call per layer), so the op's two paths are compared side by side too.
2. batched throughput: the same MoE through vllite (``LLM.generate``) and through Hugging Face transformers
   (``generate`` on the whole batch; equal-length prompts, so no padding; greedy, EOS ignored), rounds
   alternating, best round of each; output tokens per second and vllite's ratio. The first greedy tokens of
   prompt 0 are compared (float32: they should agree).

    python benchmarks/moe_decode.py --out benchmarks/results/moe_decode.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from mamba_decode import _save


def build_models(root: Path, hidden: int, layers: int, experts: int, top_k: int, inter: int,
                 max_len: int, dense_total: bool) -> dict[str, Path]:
    import transformers as tf

    common = dict(vocab_size=1024, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64,
                  num_key_value_heads=hidden // 64, max_position_embeddings=max_len)
    configs = {
        "moe": tf.MixtralConfig(**common, intermediate_size=inter, num_local_experts=experts,
                                num_experts_per_tok=top_k, architectures=["MixtralForCausalLM"]),
        "dense_active": tf.LlamaConfig(**common, intermediate_size=top_k * inter, architectures=["LlamaForCausalLM"]),
    }
    if dense_total:
        configs["dense_total"] = tf.LlamaConfig(**common, intermediate_size=experts * inter,
                                                architectures=["LlamaForCausalLM"])
    paths = {}
    for name, cfg in configs.items():
        paths[name] = root / name
        _save(cfg, paths[name])
    return paths


# Engines built with an environment of their own (the CPU platform reads it when the worker makes its model ops;
# the engine core runs in this process): the same MoE with the fused-MoE op expert by expert in Python.
ENGINE_ENV = {"moe_grouped": {"VLLITE_CPU_MOE_ONE_CALL": "0"}}


@contextlib.contextmanager
def _env(values: dict[str, str]):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def decode_side_by_side(paths: dict[str, Path], context: int, decode_tokens: int, max_len: int,
                        warmup_tokens: int) -> dict:
    """Each engine's decode steps of one request, the engines taking turns step by step; ms (fastest, median)."""
    from vllite_core import LLM, SamplingParams

    engines, requests = {}, {}
    prompt = torch.randint(0, 1024, (context,), generator=torch.Generator().manual_seed(context)).tolist()
    for name, path in paths.items():
        with _env(ENGINE_ENV.get(name, {})):
            llm = LLM(model=str(path), dtype="float32", max_model_len=max_len, max_num_seqs=1,
                      num_kv_blocks=max_len // 16 + 8, enable_prefix_caching=False)
        if warmup_tokens:
            llm.generate([{"prompt_token_ids": prompt[:8]}],
                         SamplingParams(temperature=0.0, max_tokens=warmup_tokens, ignore_eos=True))
        engine = engines[name] = llm.llm_engine
        engine.add_request("r", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0.0, max_tokens=decode_tokens + 1, ignore_eos=True))
        requests[name] = engine.core.engine_core.scheduler.requests["r"]
        while requests[name].num_output_tokens == 0:  # prefill (chunked) until the first token
            engine.step()
    times: dict[str, list[float]] = {name: [] for name in engines}
    while any(e.has_unfinished_requests() for e in engines.values()):
        for name, engine in engines.items():
            if engine.has_unfinished_requests():
                t0 = time.perf_counter()
                engine.step()
                times[name].append(time.perf_counter() - t0)
    row = {}
    for name, ts in times.items():
        row[f"{name}_ms_per_token_min"] = round(1000 * min(ts), 3)
        row[f"{name}_ms_per_token_median"] = round(1000 * statistics.median(ts), 3)
    for name in engines:
        engines[name].core.shutdown()
    return row


def throughput_against_hf(path: Path, prompts: list[list[int]], out_len: int, rounds: int) -> dict:
    """vllite and HF generate on the same batch, rounds alternating; best round's output tokens/s of each."""
    from transformers import AutoModelForCausalLM

    from vllite_core import LLM, SamplingParams

    llm = LLM(model=str(path), dtype="float32", max_model_len=len(prompts[0]) + out_len + 16,
              max_num_seqs=len(prompts), enable_prefix_caching=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    ids = torch.tensor(prompts)
    best = {"vllite": float("inf"), "hf": float("inf")}
    tokens: dict[str, list[int]] = {}
    for _ in range(rounds):
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        best["vllite"] = min(best["vllite"], time.perf_counter() - t0)
        tokens["vllite"] = list(outs[0].outputs[0].token_ids)
        t0 = time.perf_counter()
        with torch.inference_mode():
            gen = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=out_len, min_new_tokens=out_len, pad_token_id=0)
        best["hf"] = min(best["hf"], time.perf_counter() - t0)
        tokens["hf"] = gen[0, ids.shape[1]:].tolist()
    n = len(prompts) * out_len
    agree = next((i for i, (a, b) in enumerate(zip(tokens["vllite"], tokens["hf"], strict=True)) if a != b), out_len)
    llm.llm_engine.core.shutdown()
    return {"vllite_out_tok_s": round(n / best["vllite"], 1), "hf_out_tok_s": round(n / best["hf"], 1),
            "vllite_over_hf": round(best["hf"] / best["vllite"], 2), "greedy_tokens_agreeing_prompt0": agree,
            "hf_experts_implementation": str(getattr(hf.config, "_experts_implementation", None))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-inter", type=int, default=512)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--warmup-tokens", type=int, default=64, help="untimed decode steps per engine first")
    ap.add_argument("--no-dense-total", action="store_true", help="leave out the dense model of the total size")
    ap.add_argument("--with-grouped", action="store_true",
                    help="also the MoE with VLLITE_CPU_MOE_ONE_CALL=0 (CPU: its op expert by expert in Python)")
    ap.add_argument("--num-prompts", type=int, default=16, help="batched throughput: prompts in the batch")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    max_len = max(args.context + args.decode_tokens, 8 + args.warmup_tokens) + 16
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[:3]
    with tempfile.TemporaryDirectory() as tmp:
        paths = build_models(Path(tmp), args.hidden, args.layers, args.experts, args.top_k, args.expert_inter,
                             max_len, not args.no_dense_total)
        engines = {**paths, "moe_grouped": paths["moe"]} if args.with_grouped else paths
        row = decode_side_by_side(engines, args.context, args.decode_tokens, max_len, args.warmup_tokens)
        for name in engines:
            print(f"{name:>13}: {row[f'{name}_ms_per_token_min']:.2f} / {row[f'{name}_ms_per_token_median']:.2f} "
                  "ms per token (min / median)", flush=True)
        for stat in ("min", "median"):
            row[f"moe_over_dense_active_{stat}"] = round(
                row[f"moe_ms_per_token_{stat}"] / row[f"dense_active_ms_per_token_{stat}"], 2)
            if args.with_grouped:
                row[f"moe_grouped_over_dense_active_{stat}"] = round(
                    row[f"moe_grouped_ms_per_token_{stat}"] / row[f"dense_active_ms_per_token_{stat}"], 2)
            if "dense_total" in paths:
                row[f"moe_over_dense_total_{stat}"] = round(
                    row[f"moe_ms_per_token_{stat}"] / row[f"dense_total_ms_per_token_{stat}"], 2)
        print(f"MoE / dense of the active size: {row['moe_over_dense_active_min']}x fastest, "
              f"{row['moe_over_dense_active_median']}x median", flush=True)
        if args.with_grouped:
            print(f"MoE with the Python op / dense of the active size: {row['moe_grouped_over_dense_active_min']}x "
                  f"fastest, {row['moe_grouped_over_dense_active_median']}x median", flush=True)
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(17, 1024, (args.input_len,), generator=gen).tolist() for _ in range(args.num_prompts)]
        tp = throughput_against_hf(paths["moe"], prompts, args.output_len, args.rounds)
        row.update(tp)
        print(f"batched {args.num_prompts} x ({args.input_len} in, {args.output_len} out): vllite "
              f"{tp['vllite_out_tok_s']} out tok/s, HF {tp['hf_out_tok_s']} ({tp['vllite_over_hf']}x); first "
              f"{tp['greedy_tokens_agreeing_prompt0']} greedy tokens of prompt 0 agree")
    with open("/proc/loadavg") as f:
        row["load_average_before_after"] = [load_before, f.read().split()[:3]]
    if args.out:
        args.out.write_text(json.dumps({**vars(args), "out": str(args.out), **row}, indent=2) + "\n")


if __name__ == "__main__":
    main()
