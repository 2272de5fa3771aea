"""The model runner: owns the device tensors, builds one step's inputs, runs the model, samples.

Inputs are flattened (no padding across requests) and built with vectorised
numpy over the persistent batch. Logits are computed only for rows that finish
their known tokens this step (a prefill chunk in the middle of a prompt samples
nothing).

What the runner does not do itself: each feature (LoRA, multimodal and M-RoPE, cross attention,
pooling, speculative decoding, grammar bitmasks, per-request generators) is a component
(``components.py``) whose hooks the step calls in order; each cache group's metadata comes from the
builder of its spec kind (``kv_metadata.py``); every per-request field lives in the request's record
(``runner_request.py``), kept in ``requests`` from admission until the request finishes.

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

from vllite_core.attention import AttentionBackend
from vllite_core.config import VlliteConfig
from vllite_core.core.kv_cache_spec import KVCacheGroup, group_layers, plan_kv_tensors
from vllite_core.core.sched_output import NewRequestData, SchedulerOutput
from vllite_core.errors import InvalidRequestError
from vllite_core.sample.sampler import RowFaults, Sampler, SamplerOutput, gather_logprobs
from vllite_core.utils import cdiv
from vllite_core.worker.components import (
    LoRA,
    Multimodal,
    RunnerComponent,
    SpecDecode,
    build_components,
    first_of,
)
from vllite_core.worker.graph_runner import ModelForward
from vllite_core.worker.input_batch import InputBatch
from vllite_core.worker.kv_metadata import BuildContext, StepLayout, builder_for
from vllite_core.worker.runner_request import RunnerRequest
from vllite_core.worker.sampling_inputs import build_sampling_metadata

logger = logging.getLogger("vllite.runner")

# What one batch row got in a step: (row, its new tokens, their logprobs or None, drafts it verified).
StepResult = tuple[int, list[int], list | None, int]


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
    """One step's inputs. Components' ``prepare`` hooks see the host arrays (``host_*``); the runner then
    moves them to the device (``input_ids``, ``positions``, ``logits_indices``)."""

    layout: StepLayout
    layer_metadata: list[Any]  # one per cache layer; the layers of a group share one object
    sample_rows: np.ndarray  # batch rows that sample, in logits order
    # Requests wanting prompt logprobs in this step: (row, first token index, num tokens, first position).
    prompt_lp: list[tuple[int, int, int, int]]
    host_input_ids: np.ndarray
    host_positions: np.ndarray  # [T], or [3, T] with M-RoPE
    host_logits_indices: np.ndarray
    # Multimodal: (flat token indices, encoder embedding rows) replacing those tokens' embeddings.
    mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    # Speculative decoding: the drafts each sample row verifies in this step (None: no row has any).
    drafts: list[list[int]] | None = None
    grammar: Any = None  # structured output: the step's GrammarBitmask
    input_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    logits_indices: torch.Tensor | None = None

    # The scheduled batch rows in input order, their computed tokens before the step and first input index
    # (a model-based proposer runs the same tokens, vllite_core/spec_decode/model_proposer.py).
    @property
    def rows(self) -> np.ndarray:
        return self.layout.rows

    @property
    def computed(self) -> np.ndarray:
        return self.layout.computed

    @property
    def query_start(self) -> np.ndarray:
        return self.layout.query_start_loc[:-1]


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
        self.build_ctx = BuildContext(attn_backend, device, self.block_size, self.max_model_len)
        self._use_groups(group_layers(self.kv_cache_specs))
        self.sampler = Sampler(config.model_config.logprobs_mode)
        self.logits_processors = list(logits_processors or [])
        self.kv_caches: list[torch.Tensor] = []
        # Every request the runner knows, from admission until it finishes (preempted ones included).
        self.requests: dict[str, RunnerRequest] = {}
        self.load_failures: dict[str, str] = {}  # requests of this step that could not start, and why
        # Decode steps go through captured graphs when the platform made some (graph_runner.py).
        self.model_forward = ModelForward(model, attn_backend, len(self.kv_cache_specs))
        self.pooler_config = config.model_config.pooler_config
        self.components: list[RunnerComponent] = build_components(self, config)
        # The features' components by name, for the worker and tests (None: the feature is off).
        self.lora: LoRA | None = first_of(self.components, LoRA)
        mm: Multimodal | None = first_of(self.components, Multimodal)
        self.encoder_runner = mm.encoder_runner if mm is not None else None
        self.mrope = mm.mrope if mm is not None else None
        spec: SpecDecode | None = first_of(self.components, SpecDecode)
        self.proposer = spec.proposer if spec is not None else None

    def _use_groups(self, groups: list[KVCacheGroup]) -> None:
        """The cache groups the scheduler's block tables follow, and what derives from them: which group each
        layer is in, the cache tensors, the metadata builders and the (empty) batch's block tables."""
        self.kv_cache_groups = groups
        self.group_of_layer = [0] * len(self.kv_cache_specs)
        for g, group in enumerate(groups):
            for layer in group.layers:
                self.group_of_layer[layer] = g
        self.tensor_plan = plan_kv_tensors(groups, len(self.kv_cache_specs))
        self.builders = [builder_for(g.spec) for g in groups]
        self.batch = InputBatch(self.config.scheduler_config.max_num_seqs, self.max_model_len, self.block_size,
                                [b.table_width(g.spec, self.build_ctx) for b, g in zip(self.builders, groups)])

    # ---- set-up -----------------------------------------------------------------------
    def load_models(self) -> None:
        """Models of the components' own (a draft model, an EAGLE head), after the target's."""
        for c in self.components:
            c.load_model()

    def kv_cache_bytes_per_block(self) -> int:
        """Memory one block id costs in every cache tensor (in the backend's layout), the components' too."""
        own = sum(int(np.prod(builder_for(spec).tensor_shape(spec, 1, self.build_ctx))) * spec.dtype.itemsize
                  for spec in self.tensor_plan.tensor_specs)
        return own + sum(c.kv_bytes_per_block() for c in self.components)

    def _allocate_caches(self, num_blocks: int) -> list[torch.Tensor]:
        tensors = [self.attn_backend.allocate_kv_cache(builder_for(spec).tensor_shape(spec, num_blocks,
                                                                                      self.build_ctx),
                                                       spec.dtype, self.device)
                   for spec in self.tensor_plan.tensor_specs]
        return [tensors[t] for t in self.tensor_plan.tensor_of_layer]

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = self._allocate_caches(num_blocks)
        for c in self.components:
            c.initialize_kv_cache(num_blocks)

    def commit_kv_cache(self) -> None:
        """Write every page of the cache tensors now (``commit_kv_cache``): memory a platform maps lazily
        (the cpu platform's, committed as blocks are first used) is all held from start-up, a fixed
        footprint; the tensors are zero either way."""
        seen: set[int] = set()
        for t in self.kv_caches:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                t.zero_()
    def release_kv_cache(self) -> int:
        """Drop every KV cache tensor (sleep mode) and the graphs captured over them; the bytes released.
        ``initialize_kv_cache`` makes a fresh (zeroed) cache."""
        from vllite_core.worker.sleep import tensor_bytes

        freed = tensor_bytes(self.kv_caches)
        self.kv_caches = []
        self.model_forward.runners, self.model_forward.sizes = {}, []
        for c in self.components:
            c.release_kv_cache()
        return freed

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.lora.remove_lora(lora_int_id) if self.lora is not None else False

    @torch.inference_mode()
    def profile_run(self) -> None:
        """One forward pass at the largest step size, into a scratch cache, to show peak memory.
        (Encoder-decoder models skip it: their decoder needs encoder state; their memory is small.)"""
        if self.capabilities.is_encoder_decoder:
            return
        n = min(self.config.scheduler_config.max_num_batched_tokens, self.max_model_len)
        blocks = cdiv(n, self.block_size) + 1
        caches = self._allocate_caches(blocks)
        table = np.arange(1, blocks, dtype=np.int32)[None, :]
        group_md = [b.profile(g.spec, table, n, self.build_ctx) for b, g in zip(self.builders, self.kv_cache_groups)]
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        hidden = self.model(ids, torch.as_tensor(np.arange(n), device=self.device), caches,
                            [group_md[g] for g in self.group_of_layer])
        self.model.compute_logits(hidden[-1:])
        del caches, hidden

    # ---- the step ---------------------------------------------------------------------
    def _remove_row(self, req_id: str, finished: bool) -> None:
        req = self.batch.remove(req_id)
        if req is not None:
            for c in self.components:
                c.remove_request(req, finished)
        if finished:
            self.requests.pop(req_id, None)

    def _add_row(self, new: NewRequestData) -> None:
        req = self.requests.get(new.req_id)
        if req is None:
            req = self.requests[new.req_id] = RunnerRequest(new.req_id, new.num_prompt_tokens, new.sampling_params)
        req.num_prompt_tokens, req.sampling_params = new.num_prompt_tokens, new.sampling_params
        req.output_token_ids = list(new.token_ids[new.num_prompt_tokens:])
        req.eos_token_id, req.lora_request, req.prompt_logprobs = new.eos_token_id, new.lora_request, []
        for i, c in enumerate(self.components):
            try:
                c.add_request(req, new)
            except InvalidRequestError as e:  # this request alone fails (an adapter that does not load)
                for done in self.components[:i]:
                    done.remove_request(req, True)
                self.requests.pop(new.req_id, None)
                self.load_failures[new.req_id] = str(e)
                logger.warning("request %s failed: %s", new.req_id, e)
                return
        self.batch.add(req, new.token_ids, new.block_ids, new.num_computed_tokens, new.num_encoder_tokens)

    def _update_states(self, so: SchedulerOutput) -> None:
        b = self.batch
        # In a fixed order: a removal moves the last row into the hole, and every tensor-parallel rank must
        # end with the same rows (a set's order is its process's string hashing, which differs per rank).
        for rid in sorted(so.finished_req_ids):
            self._remove_row(rid, finished=True)
        for rid in sorted(so.preempted_req_ids):
            self._remove_row(rid, finished=False)
        for new in so.scheduled_new_reqs:
            self._remove_row(new.req_id, finished=False)  # resumed after preemption
            self._add_row(new)
        for c in self.components:
            c.begin_step(so)
        for cached in so.scheduled_cached_reqs:
            row = b.index[cached.req_id]
            b.append_blocks(row, cached.new_block_ids)
            b.num_computed[row] = cached.num_computed_tokens
            if cached.new_token_ids:  # jump-forward: tokens the scheduler appended without sampling
                for tok in cached.new_token_ids:
                    b.append_token(row, tok)
                b.states[row].output_token_ids.extend(cached.new_token_ids)  # type: ignore[union-attr]
        for rid, drafts in so.scheduled_spec_decode_tokens.items():  # inputs past the known tokens
            row, n = b.index[rid], len(drafts)
            b.token_ids[row, b.num_tokens[row]:b.num_tokens[row] + n] = drafts

    def _layout(self, so: SchedulerOutput) -> StepLayout:
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
        return StepLayout(rows=rows, computed=computed, num_sched=num_sched,
                          query_start_loc=np.concatenate(([0], cu)), req_idx=req_idx, positions=positions,
                          seq_lens=computed + num_sched, max_query_len=int(num_sched.max()), total=total)

    def _prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        b = self.batch
        lay = self._layout(so)
        rows, computed = lay.rows, lay.computed
        # A group without layers here (another pipeline stage's) needs no metadata.
        group_metadata = [builder.build(g.spec, b.block_tables[i], lay, b, self.build_ctx) if g.layers else None
                          for i, (builder, g) in enumerate(zip(self.builders, self.kv_cache_groups))]
        sampling = lay.seq_lens >= b.num_tokens[rows]
        prompt_lp = []
        wants = (b.num_prompt_logprobs[rows] >= 0) & (computed < b.num_prompt[rows])
        starts = lay.query_start_loc[:-1]
        for i in np.nonzero(wants)[0]:
            prompt_lp.append((int(rows[i]), int(starts[i]), int(lay.num_sched[i]), int(computed[i])))
        step = StepInputs(layout=lay, layer_metadata=[group_metadata[g] for g in self.group_of_layer],
                          sample_rows=rows[sampling], prompt_lp=prompt_lp,
                          host_input_ids=b.token_ids[rows[lay.req_idx], lay.positions],
                          host_positions=lay.positions, host_logits_indices=lay.query_start_loc[1:][sampling] - 1)
        for c in self.components:
            c.prepare(step, so)
        step.input_ids = torch.as_tensor(step.host_input_ids, device=self.device)
        step.positions = torch.as_tensor(step.host_positions, device=self.device)
        step.logits_indices = torch.as_tensor(step.host_logits_indices, device=self.device)
        return step

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

    def _sample_step(self, hidden: torch.Tensor, inp: StepInputs, so: SchedulerOutput, out: ModelRunnerOutput
                     ) -> list[StepResult]:
        """(row, tokens, their logprobs, drafts verified) of each row that got tokens in this step."""
        if inp.drafts is not None:
            from vllite_core.spec_decode.verify import verify

            return [(r.row, r.token_ids, r.logprobs, r.num_drafts)
                    for r in verify(self, hidden, inp, inp.drafts, out, inp.grammar)]
        sample_rows, sampled = self._sample(hidden, inp, out, inp.grammar)
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
        hidden = self._forward(inp)
        b = self.batch
        # Every scheduled token is now in the cache.
        for rid, n in so.num_scheduled_tokens.items():
            b.num_computed[b.index[rid]] += n
        if hidden is None:  # a pipeline stage before the last: the last one sampled, its tokens are appended here
            self._apply_results(self.exchange_results(None), out)
            return out
        if inp.prompt_lp:
            self._prompt_logprobs(hidden, inp)
        for c in self.components:
            if c.after_forward(hidden, inp, so, out):
                return out
        results = self._sample_step(hidden, inp, so, out) if len(inp.sample_rows) else []
        results = self.exchange_results(results)
        self._apply_results(results, out)
        sampled_rows = np.array([r[0] for r in results], dtype=np.int64)
        for c in self.components:
            c.after_sample(hidden, inp, sampled_rows, out)
        return out

    def _forward(self, inp: StepInputs) -> torch.Tensor | None:
        """The model's hidden states for the step's tokens (None on a pipeline stage before the last)."""
        if inp.mm_embeds is not None:  # image rows replace their placeholders' embeddings (eager: not a decode)
            return self.model(inp.input_ids, inp.positions, self.kv_caches, inp.layer_metadata,
                              inputs_embeds=self._merged_embeds(inp))
        if inp.positions.dim() > 1:  # M-RoPE prompt positions (a prompt's last tokens may look like a decode)
            return self.model(inp.input_ids, inp.positions, self.kv_caches, inp.layer_metadata)
        return self.model_forward(inp.input_ids, inp.positions, self.kv_caches, inp.layer_metadata)

    def _merged_embeds(self, inp: StepInputs) -> torch.Tensor:
        """The step's token embeddings with the encoder's rows in place of their placeholders."""
        assert inp.mm_embeds is not None
        embeds = self.model.embed_input_ids(inp.input_ids)
        embeds[inp.mm_embeds[0]] = inp.mm_embeds[1].to(embeds.dtype)
        return embeds

    def exchange_results(self, results: list[StepResult] | None) -> list[StepResult]:
        """The step's per-row results this rank appends: its own (a pipeline stage before the last has none:
        pp_runner.py)."""
        assert results is not None
        return results

    def _apply_results(self, results: list[StepResult], out: ModelRunnerOutput) -> None:
        """Append each row's new tokens to the batch and the output."""
        b = self.batch
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


def _without(so: SchedulerOutput, failed: dict[str, str]) -> SchedulerOutput:
    """The step without requests that never got a row (the scheduler keeps its own record unchanged)."""
    import dataclasses

    tokens = {rid: n for rid, n in so.num_scheduled_tokens.items() if rid not in failed}
    drafts = {rid: d for rid, d in so.scheduled_spec_decode_tokens.items() if rid not in failed}
    return dataclasses.replace(so, num_scheduled_tokens=tokens, total_num_scheduled_tokens=sum(tokens.values()),
                               scheduled_spec_decode_tokens=drafts)
