"""The runner's features as components: each owns what its feature adds to a step, behind one set of hooks.

``RunnerComponent`` declares the hooks with no-op defaults; a component overrides the ones its feature
needs, and the runner calls every hook of every component it built, in order, never asking which feature
is on. Per-request fields live in the request's record (``runner_request.RunnerRequest``), never in a
dict of the component's own. Adding a feature: write a component here (or anywhere) and list it in
``build_components``; the runner's step does not change.

The hooks, in the order a step calls them:
- ``add_request(req, new)``: a request gets a batch row (admitted, or resumed after preemption); raising
  ``InvalidRequestError`` fails that request alone (it gets no row);
- ``remove_request(req, finished)``: it loses its row (finished, or preempted: its record stays);
- ``begin_step(so)``: the batch is up to date (encoders that write caches run here);
- ``prepare(step, so)``: the step's inputs are built, still on the host; a component adds its own
  (embeddings, positions, drafts to verify, the token mapping of adapters);
- ``after_forward(hidden, step, so, out)``: the model ran; True when the component made the step's
  outputs itself (pooling: nothing is sampled);
- ``after_sample(hidden, step, sampled_rows, out)``: the rows that got tokens (drafts for the next step).
Set-up hooks: ``load_model`` (a model of the component's own), ``kv_bytes_per_block`` and
``initialize_kv_cache`` (cache tensors following the target's block ids).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol, TypeVar

import numpy as np
import torch

from vllite_core.config import VlliteConfig
from vllite_core.core.kv_cache_spec import CrossAttentionSpec
from vllite_core.core.sched_output import NewRequestData, SchedulerOutput
from vllite_core.worker.runner_request import RunnerRequest

if TYPE_CHECKING:
    from vllite_core.worker.model_runner import ModelRunner, ModelRunnerOutput, StepInputs

logger = logging.getLogger("vllite.runner")


class RunnerComponent(Protocol):
    def load_model(self) -> None:
        """After the target model is built (a draft model, an EAGLE head)."""

    def kv_bytes_per_block(self) -> int:
        """Memory one block id costs in this component's own cache tensors."""
        return 0

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """This component's pages of the target's block ids."""

    def release_kv_cache(self) -> None:
        """Drop those pages (sleep mode); ``initialize_kv_cache`` makes them again."""

    def add_request(self, req: RunnerRequest, new: NewRequestData) -> None:
        """A request gets a row; raise InvalidRequestError to fail it alone."""

    def remove_request(self, req: RunnerRequest, finished: bool) -> None:
        """A request loses its row (``finished``: its record goes too; else preempted)."""

    def begin_step(self, so: SchedulerOutput) -> None:
        """The batch holds the step's requests."""

    def prepare(self, step: StepInputs, so: SchedulerOutput) -> None:
        """Add this feature's inputs to the step (host arrays; the runner moves them to the device)."""

    def after_forward(self, hidden: torch.Tensor, step: StepInputs, so: SchedulerOutput,
                      out: ModelRunnerOutput) -> bool:
        """The model ran; True when the step's outputs are made (nothing to sample)."""
        return False

    def after_sample(self, hidden: torch.Tensor, step: StepInputs, sampled_rows: np.ndarray,
                     out: ModelRunnerOutput) -> None:
        """``sampled_rows``: the batch rows that got tokens in this step."""


class Generators(RunnerComponent):
    """Per-request generators: a seeded request's own stream, from admission until it finishes (a preempted
    request goes on with its stream)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def add_request(self, req: RunnerRequest, new: NewRequestData) -> None:
        if req.generator is None and req.sampling_params.seed is not None:
            req.generator = torch.Generator(device=self.device)
            req.generator.manual_seed(req.sampling_params.seed)


class LoRA(RunnerComponent):
    """Multi-LoRA: adapter slots on the model's linear layers (``lora/slots.py``), the adapters from this
    worker's cache (``lora/worker_cache.py``, this rank's shards), the step's token mapping."""

    def __init__(self, runner: ModelRunner) -> None:
        from vllite_core.lora.slots import LoRASlots
        from vllite_core.lora.worker_cache import WorkerLoRACache

        lc = runner.config.lora_config
        assert lc is not None
        self.runner = runner
        self.slots = LoRASlots(runner.model, lc.max_loras, lc.max_lora_rank, runner.dtype, runner.device)
        self.cache = WorkerLoRACache(runner.model, lc)
        runner.model_forward.lora = self.slots  # captured decode graphs refill the slots' mapping buffers

    @property
    def loads(self) -> int:
        """Adapters written into device slots."""
        return self.slots.loads

    def add_request(self, req: RunnerRequest, new: NewRequestData) -> None:
        if req.lora_request is not None:
            self.cache.acquire(req.lora_request)  # LoRAError (an InvalidRequestError): this request fails

    def remove_request(self, req: RunnerRequest, finished: bool) -> None:
        if req.lora_request is not None:
            self.cache.release(req.lora_request.lora_int_id)

    def prepare(self, step: StepInputs, so: SchedulerOutput) -> None:
        b = self.runner.batch
        adapters = []
        for r in step.rows.tolist():
            lr = b.states[r].lora_request  # type: ignore[union-attr]
            adapters.append(self.cache.get(lr.lora_int_id) if lr is not None else None)
        self.slots.set_rows(adapters, step.layout.req_idx)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.cache.remove(lora_int_id)


class Multimodal(RunnerComponent):
    """Multimodal decoders: encoder outputs by image content hash (``multimodal/runner.py``) replacing their
    placeholders' embeddings, and M-RoPE's three-dimensional positions (``multimodal/mrope.py``)."""

    def __init__(self, runner: ModelRunner) -> None:
        from vllite_core.distributed import get_tp
        from vllite_core.multimodal.runner import EncoderRunner

        self.runner = runner
        self.encoder_runner = EncoderRunner(runner.model)
        # With pipeline stages only the first embeds tokens: the encoder runs there alone (vLLM's way).
        self.encodes = get_tp().is_first_stage
        self.mrope = None
        if runner.capabilities.uses_mrope:
            from vllite_core.multimodal.mrope import MRopePositions

            self.mrope = MRopePositions(runner.model)

    def add_request(self, req: RunnerRequest, new: NewRequestData) -> None:
        if self.encodes:
            self.encoder_runner.add_request(req.req_id, new.mm_features)
        if self.mrope is not None:
            self.mrope.add_request(req.req_id, new.token_ids, new.num_prompt_tokens, new.mm_features)

    def remove_request(self, req: RunnerRequest, finished: bool) -> None:
        if finished:
            if self.encodes:
                self.encoder_runner.remove_request(req.req_id)
            if self.mrope is not None:
                self.mrope.remove_request(req.req_id)

    def begin_step(self, so: SchedulerOutput) -> None:
        if self.encodes:
            self.encoder_runner.update(so.free_encoder_mm_hashes, so.scheduled_encoder_inputs)

    def prepare(self, step: StepInputs, so: SchedulerOutput) -> None:
        b, lay = self.runner.batch, step.layout
        req_ids = [b.states[r].req_id for r in lay.rows.tolist()]  # type: ignore[union-attr]
        starts = lay.query_start_loc[:-1]
        if self.encodes:
            step.mm_embeds = self.encoder_runner.gather(req_ids, lay.computed, lay.num_sched, starts)
        if self.mrope is not None:
            step.host_positions = self.mrope.step_positions(req_ids, step.host_positions, starts, lay.num_sched)


class CrossAttention(RunnerComponent):
    """Encoder-decoder models: the encoder runs once per admitted request; its per-layer K/V go to the
    request's cross-attention blocks."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.layers = [i for i, s in enumerate(runner.kv_cache_specs) if isinstance(s, CrossAttentionSpec)]

    def begin_step(self, so: SchedulerOutput) -> None:
        fresh = [n for n in so.scheduled_new_reqs if n.num_encoder_tokens and n.req_id in self.runner.batch.index]
        if not fresh:
            return
        r = self.runner
        hidden = r.model.encode([n.encoder_inputs for n in fresh])
        for n, h in zip(fresh, hidden):
            pos = np.arange(n.num_encoder_tokens)
            for layer, (k, v) in zip(self.layers, r.model.cross_kv(h), strict=True):
                blocks = np.asarray(n.block_ids[r.group_of_layer[layer]], dtype=np.int64)
                slots = torch.as_tensor(blocks[pos // r.block_size] * r.block_size + pos % r.block_size,
                                        device=r.device)
                r.attn_backend.write_kv(k, v, r.kv_caches[layer], slots)


class Pooling(RunnerComponent):
    """Pooling models: requests whose prompt ends in a step are pooled instead of sampled; requests pooled
    per token keep the hidden rows of their earlier prompt chunks (in their record)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.config = runner.config.model_config.pooler_config

    def add_request(self, req: RunnerRequest, new: NewRequestData) -> None:
        p = new.pooling_params
        req.pooling_params = p
        req.per_token = p is not None and (p.per_token or self.config.pooling_type == "ALL")

    def remove_request(self, req: RunnerRequest, finished: bool) -> None:
        req.token_rows = []  # a preempted request computes its prompt again from the start

    def after_forward(self, hidden: torch.Tensor, step: StepInputs, so: SchedulerOutput,
                      out: ModelRunnerOutput) -> bool:
        self._keep_token_rows(hidden, step, so)
        if not len(step.sample_rows):
            return False
        self._pool(hidden, step, so, out)
        return True

    def _keep_token_rows(self, hidden: torch.Tensor, step: StepInputs, so: SchedulerOutput) -> None:
        """Per-token requests in the middle of their prompt: keep this chunk's hidden rows (a copy: the step's
        output buffer is reused)."""
        done = set(step.sample_rows.tolist())
        for row, start in zip(step.rows.tolist(), step.layout.query_start_loc[:-1].tolist()):
            req = self.runner.batch.states[row]
            if row in done or req is None or not req.per_token:
                continue
            n = so.num_scheduled_tokens[req.req_id]
            req.token_rows.append(hidden[start:start + n].clone())

    def _pool(self, hidden: torch.Tensor, step: StepInputs, so: SchedulerOutput, out: ModelRunnerOutput) -> None:
        """The rows each finishing request ran in this step are pooled (per-token requests: after the rows
        kept from their earlier chunks). A model's pooling fault fails requests, never the engine."""
        from vllite_core.pooling.pooler import pooled_outputs

        segments, params, per_token = [], {}, set()
        for row, end in zip(step.sample_rows.tolist(), step.logits_indices.tolist()):
            req = self.runner.batch.states[row]
            assert req is not None
            n = so.num_scheduled_tokens[req.req_id]
            rows = hidden[end + 1 - n:end + 1]
            if req.token_rows:
                rows = torch.cat(req.token_rows + [rows])
                req.token_rows = []
            segments.append((req.req_id, rows))
            params[req.req_id] = req.pooling_params
            if req.per_token:
                per_token.add(req.req_id)
        model = self.runner.model
        try:
            out.pooler_output = pooled_outputs(model, self.config, segments, params, per_token)
            return
        except Exception as e:  # noqa: BLE001 - a model's pooling fault fails requests, never the engine
            logger.warning("pooling failed for a batch of %d requests (%s: %s); pooling each alone",
                           len(segments), type(e).__name__, e)
        out.pooler_output = {}
        for seg in segments:  # one request at a time: only the ones that fault fail
            try:
                out.pooler_output.update(pooled_outputs(model, self.config, [seg], params, per_token))
            except Exception as e:  # noqa: BLE001
                out.failed[seg[0]] = f"pooling failed: {type(e).__name__}: {e}"
                logger.warning("request %s failed: %s", seg[0], out.failed[seg[0]])


class SpecDecode(RunnerComponent):
    """Speculative decoding: the drafts scheduled for verification become inputs (and logits rows); after
    sampling the proposer drafts for the next step (``spec_decode/proposer.py``)."""

    def __init__(self, runner: ModelRunner) -> None:
        from vllite_core.spec_decode.proposer import as_proposer
        from vllite_core.spec_decode.registry import resolve_proposer_factory

        sc = runner.config.speculative_config
        assert sc is not None
        self.runner = runner
        self.proposer = as_proposer(resolve_proposer_factory(sc)(sc, runner.config))

    def load_model(self) -> None:
        self.proposer.load_model(self.runner)

    def kv_bytes_per_block(self) -> int:
        return self.proposer.kv_bytes_per_block()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.proposer.initialize_kv_cache(self.runner, num_blocks)

    def release_kv_cache(self) -> None:
        self.proposer.release_kv_cache()

    def remove_request(self, req: RunnerRequest, finished: bool) -> None:
        req.draft_probs = None

    def prepare(self, step: StepInputs, so: SchedulerOutput) -> None:
        if not so.scheduled_spec_decode_tokens:
            return
        from vllite_core.spec_decode.verify import logits_indices

        b = self.runner.batch
        step.drafts = [so.scheduled_spec_decode_tokens.get(b.states[r].req_id, [])  # type: ignore[union-attr]
                       for r in step.sample_rows]
        step.host_logits_indices = logits_indices(step.host_logits_indices,
                                                  np.array([len(d) for d in step.drafts], dtype=np.int64))

    def after_sample(self, hidden: torch.Tensor, step: StepInputs, sampled_rows: np.ndarray,
                     out: ModelRunnerOutput) -> None:
        if len(sampled_rows) or self.proposer.runs_every_step:
            out.spec_token_ids = self.proposer.propose_step(self.runner, step, hidden, sampled_rows)


class GrammarBitmasks(RunnerComponent):
    """Structured output: the allowed tokens of the step's structured requests (the scheduler's bitmask),
    applied when their rows sample."""

    def prepare(self, step: StepInputs, so: SchedulerOutput) -> None:
        step.grammar = so.grammar_bitmask


def build_components(runner: ModelRunner, config: VlliteConfig) -> list[RunnerComponent]:
    """The components of the features this model and config use, in hook order."""
    caps = runner.capabilities
    comps: list[RunnerComponent] = [Generators(runner.device)]
    if config.lora_config is not None:
        comps.append(LoRA(runner))
    if caps.is_multimodal_decoder:
        comps.append(Multimodal(runner))
    if any(isinstance(s, CrossAttentionSpec) for s in runner.kv_cache_specs):
        comps.append(CrossAttention(runner))
    if config.model_config.pooler_config is not None:
        comps.append(Pooling(runner))
    if config.speculative_config is not None:
        comps.append(SpecDecode(runner))
    comps.append(GrammarBitmasks())
    return comps


C = TypeVar("C", bound=RunnerComponent)


def first_of(components: list[RunnerComponent], cls: type[C]) -> C | None:
    """The component of a class, None when its feature is off."""
    return next((c for c in components if isinstance(c, cls)), None)
