"""The model runner: owns the device tensors, builds one step's inputs, runs the model, samples.

Inputs are flattened (no padding across requests) and built with vectorised
numpy over the persistent batch. Logits are computed only for rows that finish
their known tokens this step (a prefill chunk in the middle of a prompt samples
nothing).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllite_core.attention import AttentionBackend, AttentionMetadata
from vllite_core.config import VlliteConfig
from vllite_core.core.sched_output import SchedulerOutput
from vllite_core.sample.metadata import SamplingMetadata
from vllite_core.sample.sampler import Sampler
from vllite_core.worker.input_batch import InputBatch, RequestState

logger = logging.getLogger("vllite.runner")


@dataclass
class SampleLogprobs:
    """Logprobs of one sampled position: ids[0] is the sampled token, then the top-k."""

    token_ids: list[int]
    values: list[float]
    sampled_rank: int


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[SampleLogprobs]] = field(default_factory=dict)


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor
    sample_rows: np.ndarray  # batch rows that sample, in logits order


class ModelRunner:
    def __init__(self, config: VlliteConfig, model: torch.nn.Module, attn_backend: AttentionBackend,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.config = config
        self.model = model
        self.attn_backend = attn_backend
        self.device = device
        self.dtype = dtype
        self.block_size = config.cache_config.block_size
        self.max_model_len = config.model_config.max_model_len or 0
        self.batch = InputBatch(config.scheduler_config.max_num_seqs, self.max_model_len, self.block_size)
        self.sampler = Sampler(config.model_config.logprobs_mode)
        self.kv_caches: list[torch.Tensor] = []
        # Seeded generators live until the request finishes (a preempted request keeps its stream).
        self.generators: dict[str, torch.Generator] = {}

    # ---- KV cache ---------------------------------------------------------------------
    def kv_cache_bytes_per_block(self) -> int:
        m = self.model
        shape = self.attn_backend.get_kv_cache_shape(1, self.block_size, m.num_kv_heads, m.head_size)
        elems = int(np.prod(shape))
        return elems * m.num_layers * torch.empty((), dtype=self.kv_cache_dtype()).element_size()

    def kv_cache_dtype(self) -> torch.dtype:
        return self.dtype

    def initialize_kv_cache(self, num_blocks: int) -> None:
        m = self.model
        shape = self.attn_backend.get_kv_cache_shape(num_blocks, self.block_size, m.num_kv_heads, m.head_size)
        self.kv_caches = [torch.zeros(shape, dtype=self.kv_cache_dtype(), device=self.device)
                          for _ in range(m.num_layers)]

    @torch.inference_mode()
    def profile_run(self) -> None:
        """One forward pass at the largest step size, into a scratch cache, to show peak memory."""
        n = min(self.config.scheduler_config.max_num_batched_tokens, self.max_model_len)
        blocks = -(-n // self.block_size) + 1
        m = self.model
        shape = self.attn_backend.get_kv_cache_shape(blocks, self.block_size, m.num_kv_heads, m.head_size)
        caches = [torch.zeros(shape, dtype=self.kv_cache_dtype(), device=self.device) for _ in range(m.num_layers)]
        pos = np.arange(n)
        md = self._metadata(np.array([0, n]), np.array([n]), np.arange(1, blocks, dtype=np.int32)[None, :],
                            (pos // self.block_size + 1) * self.block_size + pos % self.block_size, n, n)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        hidden = m(ids, torch.as_tensor(pos, device=self.device), caches, md)
        m.compute_logits(hidden[-1:])
        del caches, hidden

    # ---- the step ---------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        b = self.batch
        for rid in so.finished_req_ids:
            b.remove(rid)
            self.generators.pop(rid, None)
        for rid in so.preempted_req_ids:
            b.remove(rid)
        for new in so.scheduled_new_reqs:
            b.remove(new.req_id)  # resumed after preemption
            p = new.sampling_params
            gen = self.generators.get(new.req_id)
            if gen is None and p.seed is not None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(p.seed)
                self.generators[new.req_id] = gen
            state = RequestState(new.req_id, new.num_prompt_tokens, p, gen,
                                 list(new.token_ids[new.num_prompt_tokens:]))
            b.add(state, new.token_ids, new.block_ids, new.num_computed_tokens)
        for c in so.scheduled_cached_reqs:
            row = b.index[c.req_id]
            b.append_blocks(row, c.new_block_ids)
            b.num_computed[row] = c.num_computed_tokens

    def _metadata(self, query_start_loc: np.ndarray, seq_lens: np.ndarray, block_table: np.ndarray,
                  slot_mapping: np.ndarray, max_query_len: int, num_tokens: int) -> AttentionMetadata:
        dev = self.device
        md = AttentionMetadata(
            num_actual_tokens=num_tokens,
            query_start_loc=torch.as_tensor(query_start_loc.astype(np.int32), device=dev),
            seq_lens=torch.as_tensor(seq_lens.astype(np.int32), device=dev),
            block_table=torch.as_tensor(np.ascontiguousarray(block_table, dtype=np.int32), device=dev),
            slot_mapping=torch.as_tensor(slot_mapping.astype(np.int64), device=dev),
            max_query_len=int(max_query_len), max_seq_len=int(seq_lens.max()), block_size=self.block_size,
            query_start_loc_cpu=query_start_loc.tolist(), seq_lens_cpu=seq_lens.tolist())
        self.attn_backend.prepare(md)
        return md

    def _prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        b = self.batch
        rows = np.fromiter((b.index[rid] for rid in so.num_scheduled_tokens), dtype=np.int64,
                           count=len(so.num_scheduled_tokens))
        num_sched = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=len(rows))
        order = np.argsort(rows, kind="stable")
        rows, num_sched = rows[order], num_sched[order]
        total = int(num_sched.sum())
        cu = np.cumsum(num_sched)
        starts = cu - num_sched
        req_idx = np.repeat(np.arange(len(rows)), num_sched)
        computed = b.num_computed[rows]
        positions = computed[req_idx] + np.arange(total) - starts[req_idx]
        input_ids = b.token_ids[rows[req_idx], positions]
        seq_lens = computed + num_sched
        max_blocks = int(-(-seq_lens.max() // self.block_size))
        block_table = b.block_table[rows, :max_blocks]
        slot_mapping = block_table[req_idx, positions // self.block_size].astype(np.int64) * self.block_size \
            + positions % self.block_size
        md = self._metadata(np.concatenate(([0], cu)), seq_lens, block_table, slot_mapping,
                            int(num_sched.max()), total)
        sampling = seq_lens >= b.num_tokens[rows]
        return StepInputs(input_ids=torch.as_tensor(input_ids, device=self.device),
                          positions=torch.as_tensor(positions, device=self.device), metadata=md,
                          logits_indices=torch.as_tensor(cu[sampling] - 1, device=self.device),
                          sample_rows=rows[sampling])

    def _sampling_metadata(self, rows: np.ndarray) -> SamplingMetadata:
        b = self.batch
        temp = b.temperature[rows]
        greedy = temp < 1e-5
        top_k, top_p, min_p = b.top_k[rows], b.top_p[rows], b.min_p[rows]
        vocab = None
        gens = {}
        for i, row in enumerate(rows):
            st = b.states[row]
            if st is not None and st.generator is not None and not greedy[i]:
                gens[i] = st.generator
        nlp = b.num_logprobs[rows]
        dev = self.device
        use_k = bool(((top_k > 0) & ~greedy).any())
        if use_k:
            vocab = np.iinfo(np.int64).max
        return SamplingMetadata(
            temperature=torch.as_tensor(temp, device=dev),
            top_k=torch.as_tensor(np.where(top_k > 0, top_k, vocab or 0), device=dev) if use_k else None,
            top_p=torch.as_tensor(top_p, device=dev) if bool((top_p < 1.0).any()) else None,
            min_p=torch.as_tensor(min_p, device=dev) if bool((min_p > 0.0).any()) else None,
            all_greedy=bool(greedy.all()), all_random=not bool(greedy.any()), generators=gens,
            max_num_logprobs=int(nlp.max()) if bool((nlp >= 0).any()) else None)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        out = ModelRunnerOutput()
        if so.total_num_scheduled_tokens == 0:
            return out
        inp = self._prepare_inputs(so)
        hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, inp.metadata)
        b = self.batch
        # Every scheduled token is now in the cache.
        for rid, n in so.num_scheduled_tokens.items():
            b.num_computed[b.index[rid]] += n
        if len(inp.sample_rows) == 0:
            return out
        logits = self.model.compute_logits(hidden[inp.logits_indices])
        md = self._sampling_metadata(inp.sample_rows)
        sampled = self.sampler.forward(logits, md)
        tokens = sampled.sampled_token_ids.tolist()
        lp = sampled.logprobs
        lp_ids = lp.token_ids.tolist() if lp is not None else None
        lp_vals = lp.values.tolist() if lp is not None else None
        lp_ranks = lp.sampled_ranks.tolist() if lp is not None else None
        for i, row in enumerate(inp.sample_rows.tolist()):
            st = b.states[row]
            assert st is not None
            tok = tokens[i]
            b.append_token(row, tok)
            st.output_token_ids.append(tok)
            out.sampled_token_ids[st.req_id] = [tok]
            k = int(b.num_logprobs[row])
            if lp_ids is not None and k >= 0:
                out.logprobs[st.req_id] = [SampleLogprobs(lp_ids[i][:k + 1], lp_vals[i][:k + 1], lp_ranks[i])]
        return out

    def describe(self) -> dict[str, Any]:
        return {"num_reqs": self.batch.num_reqs}
