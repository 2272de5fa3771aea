"""Batch-1 decode time of a mixture of experts against dense models: the MoE's time should follow its *active*
parameters (top-k experts' worth of FFN), not its total.

Three random-weight checkpoints from transformers configs, same width, layers, attention and vocabulary: a
Mixtral with ``--experts`` experts of ``--expert-inter`` (top ``--top-k``), a Llama whose FFN is the active size
(``top_k * expert_inter``) and a Llama whose FFN is the total (``experts * expert_inter``). Each runs through
the engine (``LLM``) on the current platform, one request, prefill then ``--decode-tokens`` decode steps timed
one by one; engines take turns in one run.

    python benchmarks/moe_decode.py --out benchmarks/results/moe_decode.json
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from mamba_decode import _save, decode_ms_per_token


def build_models(root: Path, hidden: int, layers: int, experts: int, top_k: int, inter: int,
                 max_len: int) -> dict[str, Path]:
    import transformers as tf

    common = dict(vocab_size=1024, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64,
                  num_key_value_heads=hidden // 64, max_position_embeddings=max_len)
    configs = {
        "moe": tf.MixtralConfig(**common, intermediate_size=inter, num_local_experts=experts,
                                num_experts_per_tok=top_k, architectures=["MixtralForCausalLM"]),
        "dense_active": tf.LlamaConfig(**common, intermediate_size=top_k * inter, architectures=["LlamaForCausalLM"]),
        "dense_total": tf.LlamaConfig(**common, intermediate_size=experts * inter,
                                      architectures=["LlamaForCausalLM"]),
    }
    paths = {}
    for name, cfg in configs.items():
        paths[name] = root / name
        _save(cfg, paths[name])
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-inter", type=int, default=512)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    max_len = args.context + args.decode_tokens + 16
    row: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = build_models(Path(tmp), args.hidden, args.layers, args.experts, args.top_k, args.expert_inter,
                             max_len)
        for name, path in paths.items():
            fastest, median = decode_ms_per_token(path, args.context, args.decode_tokens, max_len)
            row[f"{name}_ms_per_token_min"] = round(fastest, 3)
            row[f"{name}_ms_per_token_median"] = round(median, 3)
            print(f"{name:>13}: {fastest:.2f} / {median:.2f} ms per token (min / median)", flush=True)
    row["moe_over_dense_active"] = round(row["moe_ms_per_token_median"] / row["dense_active_ms_per_token_median"], 2)
    row["moe_over_dense_total"] = round(row["moe_ms_per_token_median"] / row["dense_total_ms_per_token_median"], 2)
    print(f"MoE / dense of the active size: {row['moe_over_dense_active']}x; MoE / dense of the total size: "
          f"{row['moe_over_dense_total']}x")
    if args.out:
        args.out.write_text(json.dumps({**vars(args), "out": str(args.out), **row}, indent=2) + "\n")


if __name__ == "__main__":
    main()
