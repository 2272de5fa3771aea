"""Decode time per token against context length: a tiny Mamba2 beside a tiny Llama of the same width.

A Mamba layer's decode step reads a fixed-size state whatever the context, so its time per token stays
flat; attention reads every cached position, so the Llama's grows with the context. Both models are
random-weight checkpoints built from transformers configs (same hidden size, layers and vocabulary),
run through the engine (``LLM``) on the current platform, one request at a time: the prompt is
prefilled, then ``--decode-tokens`` decode steps are timed one by one.

    python benchmarks/mamba_decode.py --out benchmarks/results/mamba_decode.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def _save(config, path: Path) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if name.endswith("norm.weight") else p.normal_(0.0, 0.05)
    model.save_pretrained(path)
    from model_registry.source import load_tokenizer, resolve_model_source

    load_tokenizer(resolve_model_source(None)).save_pretrained(path)  # the default model's (SmolLM2's)


def build_models(root: Path, hidden: int, layers: int, max_len: int) -> dict[str, Path]:
    import transformers as tf

    common = dict(vocab_size=1024, hidden_size=hidden, num_hidden_layers=layers)
    configs = {
        "mamba2": tf.Mamba2Config(**common, state_size=64, conv_kernel=4, expand=2, head_dim=64,
                                  num_heads=2 * hidden // 64, n_groups=1, chunk_size=64,
                                  architectures=["Mamba2ForCausalLM"]),
        "llama": tf.LlamaConfig(**common, intermediate_size=4 * hidden, num_attention_heads=hidden // 64,
                                num_key_value_heads=hidden // 64, max_position_embeddings=max_len,
                                architectures=["LlamaForCausalLM"]),
    }
    paths = {}
    for name, cfg in configs.items():
        paths[name] = root / name
        _save(cfg, paths[name])
    return paths


def decode_ms_per_token(path: Path, context: int, decode_tokens: int, max_len: int) -> tuple[float, float]:
    """(fastest, median) decode step in ms: on a shared host the fastest step is the least disturbed one."""
    from vllite_core import LLM, SamplingParams

    llm = LLM(model=str(path), dtype="float32", max_model_len=max_len, max_num_seqs=1, num_kv_blocks=max_len // 16 + 8,
              enable_prefix_caching=False)
    engine = llm.llm_engine
    prompt = torch.randint(0, 1024, (context,), generator=torch.Generator().manual_seed(context)).tolist()
    engine.add_request("r", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=decode_tokens + 1, ignore_eos=True))
    req = engine.core.engine_core.scheduler.requests["r"]
    while req.num_output_tokens == 0:  # prefill (chunked) until the first token
        engine.step()
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return 1000 * min(times), 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096])
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    max_len = max(args.contexts) + args.decode_tokens + 16
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = build_models(Path(tmp), args.hidden, args.layers, max_len)
        print(f"{'context':>8} {'mamba2 ms/tok (min/median)':>27} {'llama ms/tok (min/median)':>26}")
        for ctx in args.contexts:
            row: dict = {"context": ctx}
            for name, path in paths.items():
                fastest, median = decode_ms_per_token(path, ctx, args.decode_tokens, max_len)
                row[f"{name}_ms_per_token_min"] = round(fastest, 3)
                row[f"{name}_ms_per_token_median"] = round(median, 3)
            rows.append(row)
            print(f"{ctx:>8} {row['mamba2_ms_per_token_min']:>13.2f} / {row['mamba2_ms_per_token_median']:<11.2f}"
                  f"{row['llama_ms_per_token_min']:>13.2f} / {row['llama_ms_per_token_median']:<11.2f}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"hidden": args.hidden, "layers": args.layers, "threads": args.threads,
                                        "decode_tokens": args.decode_tokens, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
