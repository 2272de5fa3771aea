"""The model runner: owns the device tensors, builds one step's inputs, runs the model, samples.

Inputs are flattened (no padding across requests) and built with vectorised
numpy over the persistent batch. Logits are computed only for rows that finish
their known tokens this step (a prefill chunk in the middle of a prompt samples
nothing).

A fault of one request (``RowFaults`` from the sampler: a logits processor raising
for its row, a non-finite logits row) fails that request alone: its id and the reason
go in ``ModelRunnerOutput.failed``, no token is sampled for it, and the other rows
are sampled again from the same logits, unchanged. Anything else raised here belongs
to no request and goes up (the engine is then dead).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllite_core.attention import AttentionBackend, AttentionMetadata
from vllite_core.config import VlliteConfig
from vllite_core.core.kv_cache_spec import (
    CrossAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    StateSpec,
    group_layers,
    plan_kv_tensors,
)
from vllite_core.core.sched_output import SchedulerOutput
from vllite_core.lora.request import LoRARequest
from vllite_core.sample.sampler import RowFaults, Sampler, SamplerOutput, gather_logprobs
from vllite_core.state_cache import build_state_metadata, state_tensor_shape
from vllite_core.utils import cdiv
from vllite_core.worker.graph_runner import ModelForward
from vllite_core.worker.input_batch import InputBatch, RowState
from vllite_core.worker.sampling_inputs import build_sampling_metadata

logger = logging.getLogger("vllite.runner")


@dataclass
class SampleLogprobs:
    """Logprobs of one position: ids[0] is the sampled (or prompt) token, then the top-k."""

    token_ids: list[int]
    values: list[float]
    sampled_rank: int


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[SampleLogprobs]] = field(default_factory=dict)
    # Complete prompt logprobs (positions 1..n-1), sent with the request's first sampled token.
    prompt_logprobs: dict[str, list[SampleLogprobs]] = field(default_factory=dict)
    # Requests that failed in this step, alone (request id -> what went wrong); they sampled nothing.
    failed: dict[str, str] = field(default_factory=dict)
    # Pooling requests whose prompt ended in this step: their result (they sampled nothing).
    pooler_output: dict[str, Any] = field(default_factory=dict)
    # Speculative decoding: the drafts proposed for each request's next step.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    layer_metadata: list[AttentionMetadata]  # one per cache layer; the layers of a group share one object
    logits_indices: torch.Tensor
    sample_rows: np.ndarray  # batch rows that sample, in logits order
    # Requests wanting prompt logprobs in this step: (row, first token index, num tokens, first position).
    prompt_lp: list[tuple[int, int, int, int]]
    # Multimodal: (flat token indices, encoder embedding rows) replacing those tokens' embeddings.
    mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    # Speculative decoding: the drafts each sample row verifies in this step (None: no row has any).
    drafts: list[list[int]] | None = None
    # The scheduled batch rows in input order, their computed tokens before the step and first input index
    # (a model-based proposer runs the same tokens, vllite_core/spec_decode/model_proposer.py).
    rows: np.ndarray | None = None
    computed: np.ndarray | None = None
    query_start: np.ndarray | None = None


class ModelRunner:
    def __init__(self, config: VlliteConfig, model: torch.nn.Module, attn_backend: AttentionBackend,
                 device: torch.device, dtype: torch.dtype, kv_cache_dtype: torch.dtype | None = None,
                 logits_processors: list[Any] | None = None) -> None:
        self.config = config
        self.model = model
        self.attn_backend = attn_backend
        self.device = device
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype or dtype
        self.block_size = config.cache_config.block_size
        self.max_model_len = config.model_config.max_model_len or 0
        self.capabilities = config.model_config.capabilities
        # The cache layout: one spec per cache layer, grouped; layers of different groups share tensors.
        self.kv_cache_specs = model.get_kv_cache_specs(self.block_size, self.kv_cache_dtype)
        self.kv_cache_groups = group_layers(self.kv_cache_specs)
        self.group_of_layer = [0] * len(self.kv_cache_specs)
        for g, group in enumerate(self.kv_cache_groups):
            for layer in group.layers:
                self.group_of_layer[layer] = g
        self.tensor_plan = plan_kv_tensors(self.kv_cache_groups, len(self.kv_cache_specs))
        self.cross_layers = [i for i, s in enumerate(self.kv_cache_specs) if isinstance(s, CrossAttentionSpec)]
        self.batch = InputBatch(config.scheduler_config.max_num_seqs, self.max_model_len, self.block_size,
                                [self._table_width(g.spec) for g in self.kv_cache_groups])
        self.sampler = Sampler(config.model_config.logprobs_mode)
        self.logits_processors = list(logits_processors or [])
        self.kv_caches: list[torch.Tensor] = []
        # Seeded generators live until the request finishes (a preempted request keeps its stream).
        self.generators: dict[str, torch.Generator] = {}
        # Decode steps go through captured graphs when the platform made some (graph_runner.py).
        self.model_forward = ModelForward(model, attn_backend, len(self.kv_cache_specs))
        self.pooler_config = config.model_config.pooler_config
        self.pooling_params: dict[str, Any] = {}  # of the pooling requests in the batch
        # Requests pooled per token (ALL): their hidden rows of earlier prompt chunks, until the prompt is complete.
        self.per_token: set[str] = set()
        self.token_rows: dict[str, list[torch.Tensor]] = {}
        # Multi-LoRA: adapter slots attached to the model's linear layers (vllite_core/lora/slots.py).
        # Multimodal models: encoder outputs by image content hash (vllite_core/multimodal/runner.py).
        self.encoder_runner = None
        if self.capabilities.is_multimodal_decoder:
            from vllite_core.multimodal.runner import EncoderRunner

            self.encoder_runner = EncoderRunner(model)
        self.mrope = None  # three-dimensional rotary positions (vllite_core/multimodal/mrope.py)
        if self.capabilities.uses_mrope:
            from vllite_core.multimodal.mrope import MRopePositions

            self.mrope = MRopePositions(model)
        self.lora = None
        self.load_failures: dict[str, str] = {}  # requests of this step that could not start, and why
        if config.lora_config is not None:
            from vllite_core.lora.slots import LoRASlots

            lc = config.lora_config
            from vllite_core.lora.worker_cache import WorkerLoRACache

            self.lora = LoRASlots(model, lc.max_loras, lc.max_lora_rank, dtype, device)
            self.lora_cache = WorkerLoRACache(model, lc)  # this rank's shards of the adapters, by id
            self.model_forward.lora = self.lora
        self.proposer = None  # speculative decoding (vllite_core/spec_decode)
        if config.speculative_config is not None:
            from vllite_core.spec_decode.registry import resolve_proposer_factory

            self.proposer = resolve_proposer_factory(config.speculative_config)(config.speculative_config, config)

    def _table_width(self, spec: KVCacheSpec) -> int:
        """Block-table columns a group needs: sliding-window tables keep dead slots (as the null block)."""
        if isinstance(spec, SlidingWindowSpec):
            return cdiv(self.max_model_len, self.block_size)
        return spec.max_blocks_per_request(self.max_model_len)

    # ---- KV cache ---------------------------------------------------------------------
    def _tensor_shape(self, spec: KVCacheSpec, num_blocks: int) -> tuple[int, ...]:
        if isinstance(spec, StateSpec):
            return state_tensor_shape(spec, num_blocks)
        return self.attn_backend.get_kv_cache_shape(num_blocks, self.block_size, spec.num_kv_heads, spec.head_size)

    def kv_cache_bytes_per_block(self) -> int:
        """Memory one block id costs in every cache tensor (in the backend's layout)."""
        own = sum(int(np.prod(self._tensor_shape(spec, 1))) * spec.dtype.itemsize
                  for spec in self.tensor_plan.tensor_specs)
        return own + (self.proposer.kv_bytes_per_block() if hasattr(self.proposer, "kv_bytes_per_block") else 0)

    def _allocate_caches(self, num_blocks: int) -> list[torch.Tensor]:
        tensors = [self.attn_backend.allocate_kv_cache(self._tensor_shape(spec, num_blocks), spec.dtype, self.device)
                   for spec in self.tensor_plan.tensor_specs]
        return [tensors[t] for t in self.tensor_plan.tensor_of_layer]

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = self._allocate_caches(num_blocks)
        if hasattr(self.proposer, "initialize_kv_cache"):  # a draft model's pages of the same block ids
            self.proposer.initialize_kv_cache(self, num_blocks)

    def _run_encoders(self, new_reqs: list[Any]) -> None:
        """Encoder once per admitted request; its per-layer K/V go to the request's cross-attention blocks."""
        hidden = self.model.encode([r.encoder_inputs for r in new_reqs])
        for r, h in zip(new_reqs, hidden):
            pos = np.arange(r.num_encoder_tokens)
            for layer, (k, v) in zip(self.cross_layers, self.model.cross_kv(h), strict=True):
                blocks = np.asarray(r.block_ids[self.group_of_layer[layer]], dtype=np.int64)
                slots = torch.as_tensor(blocks[pos // self.block_size] * self.block_size + pos % self.block_size,
                                        device=self.device)
                self.attn_backend.write_kv(k, v, self.kv_caches[layer], slots)

    @torch.inference_mode()
    def profile_run(self) -> None:
        """One forward pass at the largest step size, into a scratch cache, to show peak memory.
        (Encoder-decoder models skip it: their decoder needs encoder state; their memory is small.)"""
        if self.capabilities.is_encoder_decoder:
            return
        n = min(self.config.scheduler_config.max_num_batched_tokens, self.max_model_len)
        blocks = cdiv(n, self.block_size) + 1
        caches = self._allocate_caches(blocks)
        pos = np.arange(n)
        md = self._metadata(np.array([0, n]), np.array([n]), np.arange(1, blocks, dtype=np.int32)[None, :],
                            (pos // self.block_size + 1) * self.block_size + pos % self.block_size, n, n)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        state_md = build_state_metadata(np.array([1]), np.array([0]), np.array([0, n]), n, n, self.device)
        mds = [state_md if isinstance(spec, StateSpec) else md for spec in self.kv_cache_specs]
        hidden = self.model(ids, torch.as_tensor(pos, device=self.device), caches, mds)
        self.model.compute_logits(hidden[-1:])
        del caches, hidden

    # ---- the step ---------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        b = self.batch
        enc = self.encoder_runner
        for rid in so.finished_req_ids:
            self._remove_row(rid)
            if enc is not None:
                enc.remove_request(rid)
            if self.mrope is not None:
                self.mrope.remove_request(rid)
            self.generators.pop(rid, None)
            self.pooling_params.pop(rid, None)
            self.per_token.discard(rid)
            self.token_rows.pop(rid, None)
        for rid in so.preempted_req_ids:
            self._remove_row(rid)
            self.token_rows.pop(rid, None)  # it computes its prompt again from the start
        for new in so.scheduled_new_reqs:
            self._remove_row(new.req_id)  # resumed after preemption
            if new.lora_request is not None and not self._acquire_lora(new.req_id, new.lora_request):
                continue
            p = new.sampling_params
            gen = self.generators.get(new.req_id)
            if gen is None and p.seed is not None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(p.seed)
                self.generators[new.req_id] = gen
            state = RowState(new.req_id, new.num_prompt_tokens, p, gen,
                             list(new.token_ids[new.num_prompt_tokens:]), new.eos_token_id,
                             lora_request=new.lora_request)
            b.add(state, new.token_ids, new.block_ids, new.num_computed_tokens, new.num_encoder_tokens)
            if new.pooling_params is not None:
                self.pooling_params[new.req_id] = new.pooling_params
                self.token_rows.pop(new.req_id, None)
                if new.pooling_params.per_token or self.pooler_config.pooling_type == "ALL":
                    self.per_token.add(new.req_id)
            if enc is not None:
                enc.add_request(new.req_id, new.mm_features)
            if self.mrope is not None:
                self.mrope.add_request(new.req_id, new.token_ids, new.num_prompt_tokens, new.mm_features)
        if enc is not None:
            enc.update(so.free_encoder_mm_hashes, so.scheduled_encoder_inputs)
        if self.cross_layers:
            fresh = [n for n in so.scheduled_new_reqs if n.num_encoder_tokens]
            if fresh:
                self._run_encoders(fresh)
        for c in so.scheduled_cached_reqs:
            row = b.index[c.req_id]
            b.append_blocks(row, c.new_block_ids)
            b.num_computed[row] = c.num_computed_tokens
            if c.new_token_ids:  # jump-forward: tokens the scheduler appended without sampling
                for tok in c.new_token_ids:
                    b.append_token(row, tok)
                b.states[row].output_token_ids.extend(c.new_token_ids)  # type: ignore[union-attr]
        for rid, drafts in so.scheduled_spec_decode_tokens.items():  # inputs past the known tokens
            row, n = b.index[rid], len(drafts)
            b.token_ids[row, b.num_tokens[row]:b.num_tokens[row] + n] = drafts

    def _remove_row(self, req_id: str) -> None:
        state = self.batch.remove(req_id)
        if state is not None and state.lora_request is not None:
            self.lora_cache.release(state.lora_request.lora_int_id)

    def _acquire_lora(self, req_id: str, lora_request: LoRARequest) -> bool:
        """Load (or find) the request's adapter; a failure fails the request alone (no row for it)."""
        from vllite_core.lora.errors import LoRAError

        if self.lora is None:
            self.load_failures[req_id] = "LoRA is not enabled on this engine (enable_lora=True)"
            return False
        try:
            self.lora_cache.acquire(lora_request)
            return True
        except LoRAError as e:
            self.load_failures[req_id] = str(e)
            logger.warning("request %s failed: %s", req_id, e)
            return False

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.lora_cache.remove(lora_int_id) if self.lora is not None else False

    def _metadata(self, query_start_loc: np.ndarray, seq_lens: np.ndarray, block_table: np.ndarray,
                  slot_mapping: np.ndarray, max_query_len: int, num_tokens: int,
                  prepare: bool = True) -> AttentionMetadata:
        dev = self.device
        md = AttentionMetadata(
            num_actual_tokens=num_tokens,
            query_start_loc=torch.as_tensor(query_start_loc.astype(np.int32), device=dev),
            seq_lens=torch.as_tensor(seq_lens.astype(np.int32), device=dev),
            block_table=torch.as_tensor(np.ascontiguousarray(block_table, dtype=np.int32), device=dev),
            slot_mapping=torch.as_tensor(slot_mapping.astype(np.int64), device=dev),
            max_query_len=int(max_query_len), max_seq_len=int(seq_lens.max()), block_size=self.block_size,
            query_start_loc_cpu=query_start_loc.tolist(), seq_lens_cpu=seq_lens.tolist())
        if prepare:
            self.attn_backend.prepare(md)
        return md

    def _prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        b = self.batch
        bs = self.block_size
        rows = np.fromiter((b.index[rid] for rid in so.num_scheduled_tokens), dtype=np.int64,
                           count=len(so.num_scheduled_tokens))
        num_sched = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=len(rows))
        order = np.argsort(rows, kind="stable")
        rows, num_sched = rows[order], num_sched[order]
        total = int(num_sched.sum())
        cu = np.cumsum(num_sched)
        query_start_loc = np.concatenate(([0], cu))
        starts = cu - num_sched
        req_idx = np.repeat(np.arange(len(rows)), num_sched)
        computed = b.num_computed[rows]
        positions = computed[req_idx] + np.arange(total) - starts[req_idx]
        input_ids = b.token_ids[rows[req_idx], positions]
        seq_lens = computed + num_sched
        max_query_len = int(num_sched.max())
        if self.lora is not None:
            lrs = [b.states[r].lora_request for r in rows.tolist()]
            self.lora.set_rows([self.lora_cache.get(lr.lora_int_id) if lr is not None else None for lr in lrs],
                               req_idx)
        group_metadata = []
        for g, group in enumerate(self.kv_cache_groups):
            if isinstance(group.spec, CrossAttentionSpec):
                # Queries attend to the whole encoder output, written at admission: nothing to store.
                enc_lens = b.num_encoder_tokens[rows]
                table = b.block_tables[g][rows, :max(1, cdiv(int(enc_lens.max()), bs))]
                group_metadata.append(self._metadata(query_start_loc, enc_lens, table, np.zeros(0, dtype=np.int64),
                                                     max_query_len, total, prepare=False))
                continue
            if isinstance(group.spec, StateSpec):  # one block per request: its recurrent state
                group_metadata.append(build_state_metadata(b.block_tables[g][rows, 0], computed, query_start_loc,
                                                            max_query_len, total, self.device))
                continue
            table = b.block_tables[g][rows, :cdiv(int(seq_lens.max()), bs)]
            slot_mapping = table[req_idx, positions // bs].astype(np.int64) * bs + positions % bs
            group_metadata.append(self._metadata(query_start_loc, seq_lens, table, slot_mapping, max_query_len,
                                                 total))
        sampling = seq_lens >= b.num_tokens[rows]
        logits_indices = cu[sampling] - 1
        drafts = None
        if so.scheduled_spec_decode_tokens:
            from vllite_core.spec_decode.verify import logits_indices as spec_logits_indices

            drafts = [so.scheduled_spec_decode_tokens.get(b.states[r].req_id, []) for r in rows[sampling]]
            logits_indices = spec_logits_indices(logits_indices, np.array([len(d) for d in drafts], dtype=np.int64))
        prompt_lp = []
        wants = (b.num_prompt_logprobs[rows] >= 0) & (computed < b.num_prompt[rows])
        for i in np.nonzero(wants)[0]:
            prompt_lp.append((int(rows[i]), int(starts[i]), int(num_sched[i]), int(computed[i])))
        mm_embeds = None
        model_positions = positions
        if self.encoder_runner is not None:
            req_ids = [b.states[r].req_id for r in rows.tolist()]
            mm_embeds = self.encoder_runner.gather(req_ids, computed, num_sched, starts)
            if self.mrope is not None:
                model_positions = self.mrope.step_positions(req_ids, positions, starts, num_sched)
        return StepInputs(input_ids=torch.as_tensor(input_ids, device=self.device),
                          positions=torch.as_tensor(model_positions, device=self.device),
                          layer_metadata=[group_metadata[g] for g in self.group_of_layer],
                          logits_indices=torch.as_tensor(logits_indices, device=self.device),
                          sample_rows=rows[sampling], prompt_lp=prompt_lp, mm_embeds=mm_embeds, drafts=drafts,
                          rows=rows, computed=computed, query_start=starts)

    def _prompt_logprobs(self, hidden: torch.Tensor, inp: StepInputs) -> None:
        """Logprobs of each prompt token given the ones before it; raw, as prompt tokens are not sampled."""
        b = self.batch
        for row, start, n, first_pos in inp.prompt_lp:
            st = b.states[row]
            assert st is not None
            n_prompt = int(b.num_prompt[row])
            # Row j predicts the token at position first_pos + j + 1; keep targets inside the prompt.
            n_keep = min(n, n_prompt - 1 - first_pos)
            if n_keep <= 0:
                continue
            logits = self.model.compute_logits(hidden[start:start + n_keep]).float()
            values = self.sampler.as_mode(logits)
            targets = torch.as_tensor(b.token_ids[row, first_pos + 1:first_pos + 1 + n_keep], device=self.device)
            lp = gather_logprobs(values, targets, int(b.num_prompt_logprobs[row]))
            for ids, vals, rank in zip(lp.token_ids.tolist(), lp.values.tolist(), lp.ranks.tolist()):
                st.prompt_logprobs.append(SampleLogprobs(ids, vals, rank))

    def share_sampled(self, *tensors: torch.Tensor) -> None:
        """Make sampled ids (and verification results) the same on every rank that runs this step; one
        rank has nothing to share (tp_runner.py overrides it)."""

    def _sample(self, hidden: torch.Tensor, inp: StepInputs, out: ModelRunnerOutput, grammar: Any = None
                ) -> tuple[np.ndarray, SamplerOutput | None]:
        """Sample the step's rows; rows the sampler reports as faulty fail (``out.failed``) and the rest
        are sampled again from logits computed afresh for them (a processor may have written into the
        first ones), as if the faulty rows had never been there. Returns (rows sampled, output)."""
        b = self.batch
        alive = np.ones(len(inp.sample_rows), dtype=bool)  # over inp.sample_rows
        rows = inp.sample_rows
        logits = self.model.compute_logits(hidden[inp.logits_indices])
        while True:
            md = build_sampling_metadata(b, rows, logits.shape[-1], self.device, self.logits_processors, grammar)
            try:
                sampled = self.sampler.forward(logits, md)
                self.share_sampled(sampled.sampled_token_ids)
                return rows, sampled
            except RowFaults as f:
                where = np.nonzero(alive)[0]
                for i, msg in f.rows.items():
                    st = b.states[rows[i]]
                    assert st is not None
                    out.failed[st.req_id] = msg
                    alive[where[i]] = False
                    logger.warning("request %s failed: %s", st.req_id, msg)
                rows = inp.sample_rows[alive]
                if len(rows) == 0:
                    return rows, None
                keep = torch.as_tensor(np.nonzero(alive)[0], device=inp.logits_indices.device)
                logits = self.model.compute_logits(hidden[inp.logits_indices[keep]])

    def _keep_token_rows(self, hidden: torch.Tensor, inp: StepInputs, so: SchedulerOutput) -> None:
        """Per-token pooling requests in the middle of their prompt: keep this chunk's hidden rows (a copy:
        the step's output buffer is reused)."""
        assert inp.rows is not None and inp.query_start is not None
        done = set(inp.sample_rows.tolist())
        for row, start in zip(inp.rows.tolist(), inp.query_start.tolist()):
            st = self.batch.states[row]
            if row in done or st is None or st.req_id not in self.per_token:
                continue
            n = so.num_scheduled_tokens[st.req_id]
            self.token_rows.setdefault(st.req_id, []).append(hidden[start:start + n].clone())

    def _pool(self, hidden: torch.Tensor, inp: StepInputs, so: SchedulerOutput, out: ModelRunnerOutput) -> None:
        """Pooling requests whose prompt ended: the rows they ran in this step are pooled (per-token
        requests: after the rows kept from their earlier chunks)."""
        from vllite_core.pooling.pooler import pooled_outputs

        segments = []
        for row, end in zip(inp.sample_rows.tolist(), inp.logits_indices.tolist()):
            st = self.batch.states[row]
            assert st is not None
            n = so.num_scheduled_tokens[st.req_id]
            rows = hidden[end + 1 - n:end + 1]
            earlier = self.token_rows.pop(st.req_id, None)
            if earlier:
                rows = torch.cat(earlier + [rows])
            segments.append((st.req_id, rows))
        cfg, params, per_token = self.pooler_config, self.pooling_params, self.per_token
        try:
            out.pooler_output = pooled_outputs(self.model, cfg, segments, params, per_token)
            return
        except Exception as e:  # noqa: BLE001 - a model's pooling fault fails requests, never the engine
            logger.warning("pooling failed for a batch of %d requests (%s: %s); pooling each alone",
                           len(segments), type(e).__name__, e)
        out.pooler_output = {}
        for seg in segments:  # one request at a time: only the ones that fault fail
            try:
                out.pooler_output.update(pooled_outputs(self.model, cfg, [seg], params, per_token))
            except Exception as e:  # noqa: BLE001
                out.failed[seg[0]] = f"pooling failed: {type(e).__name__}: {e}"
                logger.warning("request %s failed: %s", seg[0], out.failed[seg[0]])

    def _sample_step(self, hidden: torch.Tensor, inp: StepInputs, so: SchedulerOutput, out: ModelRunnerOutput
                     ) -> list[tuple[int, list[int], list | None, int]]:
        """(row, tokens, their logprobs, drafts verified) of each row that got tokens in this step."""
        if inp.drafts is not None:
            from vllite_core.spec_decode.verify import verify

            return [(r.row, r.token_ids, r.logprobs, r.num_drafts)
                    for r in verify(self, hidden, inp, inp.drafts, out, so.grammar_bitmask)]
        sample_rows, sampled = self._sample(hidden, inp, out, so.grammar_bitmask)
        if sampled is None:
            return []
        tokens = sampled.sampled_token_ids.tolist()
        lp = sampled.logprobs
        lps = zip(lp.token_ids.tolist(), lp.values.tolist(), lp.ranks.tolist()) if lp is not None else None
        return [(row, [tokens[i]], [next(lps)] if lps is not None else None, 0)
                for i, row in enumerate(sample_rows.tolist())]

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        out = ModelRunnerOutput()
        if self.load_failures:  # requests that could not start (their adapter did not load): not run
            out.failed, self.load_failures = self.load_failures, {}
            so = _without(so, out.failed)
        if so.total_num_scheduled_tokens == 0:
            return out
        inp = self._prepare_inputs(so)
        if inp.mm_embeds is not None:  # image rows replace their placeholders' embeddings (eager: not a decode)
            embeds = self.model.embed_input_ids(inp.input_ids)
            embeds[inp.mm_embeds[0]] = inp.mm_embeds[1].to(embeds.dtype)
            hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, inp.layer_metadata,
                                inputs_embeds=embeds)
        elif inp.positions.dim() > 1:  # M-RoPE prompt positions (a prompt's last tokens may look like a decode)
            hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, inp.layer_metadata)
        else:
            hidden = self.model_forward(inp.input_ids, inp.positions, self.kv_caches, inp.layer_metadata)
        b = self.batch
        # Every scheduled token is now in the cache.
        for rid, n in so.num_scheduled_tokens.items():
            b.num_computed[b.index[rid]] += n
        if inp.prompt_lp:
            self._prompt_logprobs(hidden, inp)
        if self.per_token:
            self._keep_token_rows(hidden, inp, so)
        if len(inp.sample_rows) and self.pooler_config is not None:
            self._pool(hidden, inp, so, out)
            return out
        results = self._sample_step(hidden, inp, so, out) if len(inp.sample_rows) else []
        for row, toks, lps_row, num_drafts in results:
            st = b.states[row]
            assert st is not None
            for tok in toks:
                b.append_token(row, tok)
            st.output_token_ids.extend(toks)
            b.num_computed[row] -= num_drafts + 1 - len(toks)  # rejected drafts: their slots are rewritten later
            out.sampled_token_ids[st.req_id] = toks
            k = int(b.num_logprobs[row])
            if lps_row is not None and k >= 0:
                out.logprobs[st.req_id] = [SampleLogprobs(ids[:k + 1], vals[:k + 1], rank)
                                           for ids, vals, rank in lps_row]
            if b.num_prompt_logprobs[row] >= 0 and len(st.output_token_ids) == len(toks):
                out.prompt_logprobs[st.req_id] = st.prompt_logprobs
                st.prompt_logprobs = []
        if self.proposer is not None and (results or hasattr(self.proposer, "propose_step")):
            sampled_rows = np.array([r[0] for r in results], dtype=np.int64)
            if hasattr(self.proposer, "propose_step"):  # a model of its own: runs on this step's tokens
                out.spec_token_ids = self.proposer.propose_step(self, inp, hidden, sampled_rows)
            else:
                from vllite_core.spec_decode.verify import propose

                out.spec_token_ids = propose(self.proposer, b, sampled_rows)
        return out


def _without(so: SchedulerOutput, failed: dict[str, str]) -> SchedulerOutput:
    """The step without requests that never got a row (the scheduler keeps its own record unchanged)."""
    import dataclasses

    tokens = {rid: n for rid, n in so.num_scheduled_tokens.items() if rid not in failed}
    drafts = {rid: d for rid, d in so.scheduled_spec_decode_tokens.items() if rid not in failed}
    return dataclasses.replace(so, num_scheduled_tokens=tokens, total_num_scheduled_tokens=sum(tokens.values()),
                               scheduled_spec_decode_tokens=drafts)
