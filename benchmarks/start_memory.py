"""Each engine's memory at start beside its checkpoint's size, every engine in a fresh process of its own.

    python benchmarks/start_memory.py [--engine bf16=/tmp/peers/models/llama1b ...] [--output-json out.json]
    python benchmarks/start_memory.py --engine q4km=/tmp/peers/models/llama1b-q4_k_m.gguf   # a GGUF file's blocks

Default engines: prequant_decode.py's (the Llama-3.2-1B-shaped bf16 checkpoint and its W4A16 and FP8-block
versions, loaded in a bfloat16 model with no ``quantization`` argument, 64 MiB of KV cache). A child process per
engine imports vllite, then reads its resident set (VmRSS, and of it RssFile: pages of mapped files) before
``LLM(...)``, after it (the process's peak, VmHWM, too) and after one short request (copies packed on first use);
reported beside the bytes of the tensors the model holds and of its ``*.safetensors`` files. prequant_decode.py
starts its engines in one process, where one engine's growth depends on what the one before it freed; here none
does.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MIB = 1 << 20


def status() -> dict[str, int]:
    """VmRSS, RssFile and VmHWM of this process, in MiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "RssFile", "VmHWM"):
                out[key] = int(line.split()[1]) >> 10
    return out


def child(name: str, folder: str) -> None:
    import logging

    from prequant_decode import KV_BYTES, files_bytes, held_bytes

    from vllite_core import LLM, SamplingParams

    logging.disable(logging.WARNING)
    gguf = folder.endswith(".gguf")  # a GGUF file: its blocks (quantization="gguf")
    before = status()
    t0 = time.perf_counter()
    llm = LLM(model=folder, dtype="bfloat16", max_model_len=64, max_num_seqs=1, enable_prefix_caching=False,
              num_threads=2, kv_cache_memory=KV_BYTES, quantization="gguf" if gguf else None)
    start_s = time.perf_counter() - t0
    started = status()
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    stepped = status()
    model = llm.llm_engine.core.engine_core.worker.runner.model
    held = held_bytes(model)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    blocks: dict[int, int] = {}  # GGUF blocks outside the parameters (the vocabulary's, a fused layer's shards)
    for m in model.modules():
        method = getattr(m, "quant_method", None)
        for w in getattr(method, "parts", None) or [getattr(method, "gguf_weight", None), getattr(m, "blocks", None)]:
            if w is not None and w.blocks.untyped_storage().data_ptr() not in params:
                blocks[w.blocks.untyped_storage().data_ptr()] = w.nbytes()
    held += sum(blocks.values())
    files = os.path.getsize(folder) if gguf else files_bytes(folder)
    row = {"engine": name, "start_s": round(start_s, 2), "files_mib": round(files / MIB), "held_mib": round(held / MIB),
           "kv_cache_mib": KV_BYTES // MIB, "start_growth_mib": started["VmRSS"] - before["VmRSS"],
           "start_file_pages_mib": started["RssFile"] - before["RssFile"],
           "peak_growth_mib": started["VmHWM"] - before["VmRSS"],
           "first_step_growth_mib": stepped["VmRSS"] - started["VmRSS"]}
    row["start_over_files"] = round((row["start_growth_mib"] - row["kv_cache_mib"]) / row["files_mib"], 3)
    print("@@" + json.dumps(row), flush=True)


def main() -> None:
    from prequant_decode import DEFAULT_ENGINES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", action="append", help="name=folder (repeatable)")
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(*a.child)
        return
    rows = []
    for spec in a.engine or DEFAULT_ENGINES:
        name, folder = spec.split("=", 1)
        out = subprocess.run([sys.executable, __file__, "--child", name, folder], capture_output=True, text=True,
                             check=True).stdout
        rows.append(json.loads(next(ln[2:] for ln in out.splitlines() if ln.startswith("@@"))))
    print("| engine | start, s | files, MiB | tensors held | RSS growth at start (of it file pages) | "
          "peak while starting | + first step | (start - KV) / files |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['engine']} | {r['start_s']} | {r['files_mib']} | {r['held_mib']} | {r['start_growth_mib']} "
              f"({r['start_file_pages_mib']}) | {r['peak_growth_mib']} | +{r['first_step_growth_mib']} | "
              f"{r['start_over_files']} |")
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump({"kv_cache_mib": rows[0]["kv_cache_mib"] if rows else 0, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
