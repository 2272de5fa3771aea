"""Build a step's SamplingMetadata from the persistent batch.

Everything a row does not use stays None, so the common case (temperature,
maybe top-p) costs a few small tensor copies. Per-request work loops over the
rows that need it and over their words or ids, never over the vocabulary.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vllite_core.sample.logits_processor import BatchInfo
from vllite_core.sample.metadata import SamplingMetadata
from vllite_core.sampling_params import GREEDY_EPS
from vllite_core.worker.input_batch import InputBatch


def _padded(lists: list[list[int]], fill: int) -> torch.Tensor:
    width = max((len(x) for x in lists), default=0)
    out = np.full((len(lists), max(width, 1)), fill, dtype=np.int64)
    for i, x in enumerate(lists):
        out[i, :len(x)] = x
    return torch.from_numpy(out)


def _counts(lists: list[list[int]], vocab: int) -> torch.Tensor:
    idx = _padded(lists, vocab)
    counts = torch.zeros(len(lists), vocab + 1, dtype=torch.float32)
    counts.scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.float32))
    return counts[:, :vocab]


def build_sampling_metadata(b: InputBatch, rows: np.ndarray, vocab: int, device: torch.device,
                            processors: list[Any], grammar: Any = None,
                            extra_outputs: list[list[int]] | None = None) -> SamplingMetadata:
    """``rows`` may repeat a batch row (speculative decoding verifies several positions of a request);
    ``extra_outputs[i]`` then extends row i's output history (the drafts before that position), so
    penalties, bad words, min_tokens and processors see what a non-speculative step would."""
    temp = b.temperature[rows]
    greedy = temp < GREEDY_EPS
    top_k, top_p, min_p = b.top_k[rows], b.top_p[rows], b.min_p[rows]
    states = [b.states[r] for r in rows]
    histories = [st.output_token_ids for st in states] if extra_outputs is None else \
        [st.output_token_ids + extra if extra else st.output_token_ids for st, extra in zip(states, extra_outputs)]
    gens = {i: st.generator for i, st in enumerate(states)
            if st is not None and st.generator is not None and not greedy[i]}
    nlp = b.num_logprobs[rows]
    use_k = bool(((top_k > 0) & ~greedy).any())
    md = SamplingMetadata(
        temperature=torch.as_tensor(temp, device=device),
        top_k=torch.as_tensor(np.where(top_k > 0, top_k, vocab), device=device) if use_k else None,
        top_p=torch.as_tensor(top_p, device=device) if bool((top_p < 1.0).any()) else None,
        min_p=torch.as_tensor(min_p, device=device) if bool((min_p > 0.0).any()) else None,
        all_greedy=bool(greedy.all()), all_random=not bool(greedy.any()), generators=gens,
        max_num_logprobs=int(nlp.max()) if bool((nlp >= 0).any()) else None)

    outputs = None
    pres, freq, rep = b.presence[rows], b.frequency[rows], b.repetition[rows]
    if bool((pres != 0).any() or (freq != 0).any() or (rep != 1).any()):
        outputs = histories
        md.output_counts = _counts(outputs, vocab).to(device)
        if bool((pres != 0).any()):
            md.presence = torch.as_tensor(pres, device=device)
        if bool((freq != 0).any()):
            md.frequency = torch.as_tensor(freq, device=device)
        if bool((rep != 1).any()):
            md.repetition = torch.as_tensor(rep, device=device)
            prompts = [b.token_ids[r, :b.num_prompt[r]].tolist() for r in rows]
            md.seen_mask = (_counts(prompts, vocab) > 0).to(device) | (md.output_counts > 0)

    if bool(b.has_constraints[rows].any()):
        _add_constraints(md, states, histories, b.has_constraints[rows], vocab, device)

    if grammar is not None:
        _add_grammar(md, states, grammar, device)

    if processors:
        md.processors = processors
        md.batch_info = BatchInfo(
            req_ids=[st.req_id for st in states], params=[st.sampling_params for st in states],
            prompt_token_ids=[b.token_ids[r, :b.num_prompt[r]].tolist() for r in rows],
            output_token_ids=histories)
    return md


def _add_constraints(md: SamplingMetadata, states: list[Any], histories: list[list[int]], flagged: np.ndarray,
                     vocab: int, device: torch.device) -> None:
    ban_rows: list[int] = []
    ban_ids: list[int] = []
    bias_rows: list[int] = []
    bias_ids: list[int] = []
    bias_vals: list[float] = []
    allowed: torch.Tensor | None = None
    for i, st in enumerate(states):
        if not flagged[i]:
            continue
        p = st.sampling_params
        out = histories[i]
        if p.allowed_token_ids:
            if allowed is None:
                allowed = torch.ones(len(states), vocab, dtype=torch.bool)
            allowed[i] = False
            allowed[i, p.allowed_token_ids] = True
        for seq in p.bad_words_token_ids:
            # Ban the word's last token when the tokens before it were just generated.
            prefix = seq[:-1]
            if not prefix or out[-len(prefix):] == prefix:
                ban_rows.append(i)
                ban_ids.append(seq[-1])
        if len(out) < p.min_tokens:
            for tid in ([st.eos_token_id] if st.eos_token_id is not None and not p.ignore_eos else []) \
                    + list(p.stop_token_ids):
                ban_rows.append(i)
                ban_ids.append(tid)
        for tid, val in (p.logit_bias or {}).items():
            bias_rows.append(i)
            bias_ids.append(tid)
            bias_vals.append(val)
    if allowed is not None:
        md.allowed_mask = allowed.to(device)
    if ban_rows:
        md.banned = (torch.tensor(ban_rows, device=device), torch.tensor(ban_ids, device=device))
    if bias_rows:
        md.bias = (torch.tensor(bias_rows, device=device), torch.tensor(bias_ids, device=device),
                   torch.tensor(bias_vals, dtype=torch.float32, device=device))


def _add_grammar(md: SamplingMetadata, states: list[Any], grammar: Any, device: torch.device) -> None:
    """The step's grammar bitmask (structured_output.GrammarBitmask), gathered into this batch's row order."""
    mine = [(i, grammar.rows[st.req_id]) for i, st in enumerate(states) if st.req_id in grammar.rows]
    if mine:
        md.grammar_rows = torch.tensor([i for i, _ in mine], dtype=torch.long, device=device)
        md.grammar_bitmask = grammar.bitmask[torch.tensor([j for _, j in mine], dtype=torch.long)].to(device)
