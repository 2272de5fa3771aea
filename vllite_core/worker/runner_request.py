"""The runner's record of one request: every per-request field a runner feature keeps, in one place.

A record lives from the step that admits the request until the step that sees it finished; a
preempted request keeps its record (its seeded generator goes on where it stopped) and loses its
batch row. The persistent batch (``input_batch.py``) holds the per-row arrays and points each row at
its record, so a feature never keeps a dict keyed by request id of its own, and never a cleanup line.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vllite_core.lora.request import LoRARequest
from vllite_core.sampling_params import SamplingParams


@dataclass
class RunnerRequest:
    req_id: str
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    output_token_ids: list[int] = field(default_factory=list)
    # Prompt logprobs gathered chunk by chunk until the prefill completes.
    prompt_logprobs: list = field(default_factory=list)
    # Per-request generators: a seeded request's stream (kept across preemption).
    generator: torch.Generator | None = None
    # LoRA: the adapter by id (the worker's cache holds its tensors, pinned while the request has a row).
    lora_request: LoRARequest | None = None
    # Pooling: the request's PoolingParams; pooled per token: its hidden rows of earlier prompt chunks.
    pooling_params: Any = None
    per_token: bool = False
    token_rows: list[torch.Tensor] = field(default_factory=list)
    # Speculative decoding (model-based proposers): q of the stored drafts ([num_drafts, vocab] float32), for
    # requests sampled at random; None: one-hot at each draft.
    draft_probs: torch.Tensor | None = None
