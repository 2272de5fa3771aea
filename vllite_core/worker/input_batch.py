"""The persistent input batch: per-request rows of host arrays kept across steps.

A request keeps its row while it runs, so a step only writes what changed (new
blocks, a sampled token) instead of rebuilding every request's inputs. Rows are
kept dense (0..n-1) by moving the last row into a hole when a request leaves. Each row points at its
request's record (``runner_request.RunnerRequest``: the Python objects beside the arrays).
"""
from __future__ import annotations

import numpy as np

from vllite_core.worker.runner_request import RunnerRequest


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int, table_widths: list[int]) -> None:
        """``table_widths``: the most blocks a request holds in each cache group (one block table per group)."""
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)  # tokens known (prompt + sampled)
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_tables = [np.zeros((max_num_reqs, w), dtype=np.int32) for w in table_widths]
        self.num_blocks = np.zeros((len(table_widths), max_num_reqs), dtype=np.int64)
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)
        self.num_prompt_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)
        self.num_prompt = np.zeros(max_num_reqs, dtype=np.int64)
        self.presence = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition = np.ones(max_num_reqs, dtype=np.float32)
        # Rows whose params need per-request work (bad words, bias, allowed ids, min_tokens).
        self.has_constraints = np.zeros(max_num_reqs, dtype=bool)
        # Encoder-decoder models: the encoder output's length (the cross-attention context).
        self.num_encoder_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.states: list[RunnerRequest | None] = [None] * max_num_reqs
        self.index: dict[str, int] = {}

    @property
    def num_reqs(self) -> int:
        return len(self.index)

    def add(self, state: RunnerRequest, token_ids: list[int], block_ids: list[list[int]], num_computed: int,
            num_encoder_tokens: int = 0) -> int:
        row = self.num_reqs
        if row >= self.max_num_reqs:
            raise RuntimeError("input batch is full (max_num_seqs)")
        n = len(token_ids)
        self.token_ids[row, :n] = token_ids
        self.num_tokens[row] = n
        self.num_computed[row] = num_computed
        for g, ids in enumerate(block_ids):
            self.block_tables[g][row, :len(ids)] = ids
            self.num_blocks[g, row] = len(ids)
        self.num_encoder_tokens[row] = num_encoder_tokens
        p = state.sampling_params
        self.temperature[row] = p.temperature
        self.top_k[row] = p.top_k
        self.top_p[row] = p.top_p
        self.min_p[row] = p.min_p
        self.num_logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.num_prompt_logprobs[row] = -1 if p.prompt_logprobs is None else p.prompt_logprobs
        self.num_prompt[row] = state.num_prompt_tokens
        self.presence[row] = p.presence_penalty
        self.frequency[row] = p.frequency_penalty
        self.repetition[row] = p.repetition_penalty
        self.has_constraints[row] = bool(p.bad_words_token_ids or p.logit_bias or p.allowed_token_ids
                                         or p.min_tokens > 0)
        self.states[row] = state
        self.index[state.req_id] = row
        return row

    def append_blocks(self, row: int, block_ids: list[list[int]]) -> None:
        for g, ids in enumerate(block_ids):
            if ids:
                start = self.num_blocks[g, row]
                self.block_tables[g][row, start:start + len(ids)] = ids
                self.num_blocks[g, row] = start + len(ids)

    def append_token(self, row: int, token: int) -> None:
        n = self.num_tokens[row]
        if n < self.max_model_len:
            self.token_ids[row, n] = token
        self.num_tokens[row] = n + 1

    def remove(self, req_id: str) -> RunnerRequest | None:
        """Remove a request and fill its row with the last one, keeping rows dense."""
        row = self.index.pop(req_id, None)
        if row is None:
            return None
        state = self.states[row]
        last = self.num_reqs  # index of the former last row (after pop)
        if row != last:
            self._move(last, row)
        self.states[last] = None
        return state

    def _move(self, src: int, dst: int) -> None:
        n = self.num_tokens[src]
        self.token_ids[dst, :min(n, self.max_model_len)] = self.token_ids[src, :min(n, self.max_model_len)]
        for g, table in enumerate(self.block_tables):
            nb = self.num_blocks[g, src]
            table[dst, :nb] = table[src, :nb]
        self.num_blocks[:, dst] = self.num_blocks[:, src]
        for arr in (self.num_tokens, self.num_computed, self.temperature, self.top_k,
                    self.top_p, self.min_p, self.num_logprobs, self.num_prompt_logprobs, self.num_prompt,
                    self.presence, self.frequency, self.repetition, self.has_constraints,
                    self.num_encoder_tokens):
            arr[dst] = arr[src]
        state = self.states[src]
        self.states[dst] = state
        assert state is not None
        self.index[state.req_id] = dst
