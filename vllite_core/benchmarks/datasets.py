"""Benchmark workloads: random token ids (the shared peer workload) or a dataset file.

The random workload is exactly the one every peer engine is measured on
(``shared/peers/workload.py``): ``numpy.random.RandomState(seed).randint(17, 49152,
size=(n, input_len))``, i.e. ids from the non-special part of the SmolLM2
vocabulary, no BOS, no tokenization. For a model with a smaller vocabulary the
upper bound drops to its vocabulary size.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

FIRST_NORMAL_ID = 17  # SmolLM2: ids 0..16 are special tokens
SMOLLM2_VOCAB = 49152


@dataclass
class BenchRequest:
    prompt_token_ids: list[int] | None
    prompt: str | None
    output_len: int

    @property
    def input_len(self) -> int:
        return len(self.prompt_token_ids) if self.prompt_token_ids is not None else 0

    def engine_prompt(self) -> dict[str, Any]:
        if self.prompt_token_ids is not None:
            return {"prompt_token_ids": self.prompt_token_ids}
        return {"prompt": self.prompt}


def random_token_ids(n: int, input_len: int, seed: int = 0, vocab_size: int | None = None,
                     low: int = FIRST_NORMAL_ID) -> list[list[int]]:
    """The shared workload: n rows of ``input_len`` ids in [low, min(49152, vocab_size))."""
    high = SMOLLM2_VOCAB if vocab_size is None else min(SMOLLM2_VOCAB, int(vocab_size))
    low = min(low, max(high - 1, 0))
    rs = np.random.RandomState(seed)
    return [row.tolist() for row in rs.randint(low, high, size=(n, input_len))]


def random_requests(n: int, input_len: int, output_len: int, seed: int = 0,
                    vocab_size: int | None = None) -> list[BenchRequest]:
    return [BenchRequest(ids, None, output_len) for ids in random_token_ids(n, input_len, seed, vocab_size)]


def load_dataset(path: str, num_prompts: int | None, output_len: int, tokenizer: Any = None) -> list[BenchRequest]:
    """Requests from a file: JSONL (one object per line) or a JSON list.

    Each entry is ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}``, with an
    optional ``"output_len"`` (else ``output_len``). ShareGPT-style entries
    (``{"conversations": [{"value": ...}, ...]}``) use their first turn as the prompt.
    Text prompts are tokenized with ``tokenizer`` when given (so input lengths are known).
    """
    with open(path, encoding="utf-8") as f:
        text = f.read()
    stripped = text.lstrip()
    if stripped.startswith("["):
        entries = json.loads(text)
    else:
        entries = []
        for n, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if line:
                try:
                    entries.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not JSON: {e}") from None
    out: list[BenchRequest] = []
    for i, e in enumerate(entries):
        if isinstance(e, str):
            e = {"prompt": e}
        if not isinstance(e, dict):
            raise ValueError(f"{path}: entry {i} must be an object or a string")
        olen = int(e.get("output_len", output_len))
        if "prompt_token_ids" in e:
            ids = [int(t) for t in e["prompt_token_ids"]]
            out.append(BenchRequest(ids, None, olen))
        else:
            prompt = e.get("prompt")
            if prompt is None and isinstance(e.get("conversations"), list) and e["conversations"]:
                prompt = e["conversations"][0].get("value")
            if not isinstance(prompt, str):
                raise ValueError(f"{path}: entry {i} has neither 'prompt' nor 'prompt_token_ids'")
            ids = list(tokenizer.encode(prompt, add_special_tokens=False)) if tokenizer is not None else None
            out.append(BenchRequest(ids, prompt, olen) if ids is None else BenchRequest(ids, prompt, olen))
        if num_prompts is not None and len(out) >= num_prompts:
            break
    if not out:
        raise ValueError(f"{path}: no requests")
    return out


def digest(rows: list[list[int]]) -> str:
    """Short hash of a token-id workload (the peers' digest: sha256 of its JSON)."""
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]
