"""The model runner of one rank of a pipeline stage (``pipeline_parallel_size`` > 1).

Every rank of every stage gets the same scheduler output and keeps the same batch state; each runs
only its stage's layers over its own KV cache (its layers' only). The first stage embeds the step's
tokens, each stage before the last sends (hidden states, residual) to the same tensor-parallel rank
of the next stage and the next receives them (``vllite_core.distributed.pipeline``); the last stage
normalises, computes logits and samples and appends the sampled tokens to its batch. The other stages
never wait for the last: the scheduler names the tokens each step computes (``CachedRequestData.token_ids``),
which is how they learn the sampled ones, so several batches can be in flight at once (the engine core's
batch queue): stage 0 runs batch B while stage 1 runs batch A.
"""
from __future__ import annotations

import numpy as np
import torch

from vllite_core.core.kv_cache_spec import KVCacheGroup, KVCacheSpec
from vllite_core.core.sched_output import SchedulerOutput
from vllite_core.distributed import get_tp
from vllite_core.distributed.pipeline import IntermediateTensors, PipelineChannel
from vllite_core.utils import cdiv
from vllite_core.worker.model_runner import StepInputs, StepResult
from vllite_core.worker.tp_runner import TensorParallelModelRunner


class PipelineParallelModelRunner(TensorParallelModelRunner):
    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 - ModelRunner's
        super().__init__(*args, **kwargs)
        st = get_tp()
        self.channel = PipelineChannel(st.global_rank, st.world_size, st.pp_rank, st.pp_size)
        self.hidden_size = int(self.model.hidden_size)
        # Whether the model hands a residual stream beside the hidden states (layers that add their own: no).
        self.sends_residual = bool(getattr(self.model, "pipeline_residual", True))

    def align_kv_cache_groups(self, specs: list[KVCacheSpec]) -> None:
        """Take the engine's cache groups, every stage's in one order (the scheduler keeps one block table per
        group for all stages): a group whose layers sit on other stages is kept here without layers, so this
        rank allocates none of its memory, and block ids mean the same group on every stage."""
        missing = [s for s in self.kv_cache_specs if s not in specs]
        assert not missing, f"a layer's cache spec is not among the engine's groups: {missing[0]}"
        self._use_groups([KVCacheGroup(spec, tuple(i for i, s in enumerate(self.kv_cache_specs) if s == spec))
                          for spec in specs])

    def _run_stage(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[torch.Tensor],
                   layer_metadata: list, received: IntermediateTensors | None) -> torch.Tensor | None:
        return self._handed_on(self.model(input_ids, positions, caches, layer_metadata, intermediate=received))

    def _handed_on(self, out: torch.Tensor | IntermediateTensors) -> torch.Tensor | None:
        """A stage before the last sends its output on (and has no hidden states to sample from)."""
        if isinstance(out, IntermediateTensors):
            self.channel.send(out)
            return None
        return out

    def _receive(self, num_tokens: int) -> IntermediateTensors | None:
        return None if self.channel.is_first else self.channel.recv(num_tokens, self.hidden_size, self.dtype,
                                                                     self.device, self.sends_residual)

    def _forward(self, inp: StepInputs) -> torch.Tensor | None:
        assert inp.input_ids is not None and inp.positions is not None
        received = self._receive(int(inp.input_ids.shape[0]))
        if inp.mm_embeds is not None and received is None:  # the first stage puts the image rows in place
            return self._handed_on(self.model(inp.input_ids, inp.positions, self.kv_caches, inp.layer_metadata,
                                              inputs_embeds=self._merged_embeds(inp), intermediate=None))
        return self._run_stage(inp.input_ids, inp.positions, self.kv_caches, inp.layer_metadata, received)

    def _update_states(self, so: SchedulerOutput) -> None:
        """A stage that does not sample takes the step's tokens from the scheduler (the last stage sampled
        them and appended them itself)."""
        super()._update_states(so)
        if self.channel.is_last:
            return
        b = self.batch
        for cached in so.scheduled_cached_reqs:
            assert cached.token_ids is not None
            row, start = b.index[cached.req_id], cached.num_computed_tokens
            end = start + len(cached.token_ids)
            b.token_ids[row, start:end] = cached.token_ids
            b.num_tokens[row] = max(int(b.num_tokens[row]), end)

    def exchange_results(self, results: list[StepResult] | None) -> list[StepResult]:
        """Nothing crosses the stages after a step: a stage before the last has no tokens to append (they come
        with the request's next step), the last keeps its own."""
        return [] if results is None else results

    @torch.inference_mode()
    def profile_run(self) -> None:
        """One forward pass of this stage at the largest step size (the activations a previous stage would send
        are received as zeros here: nothing is sent while profiling)."""
        n = min(self.config.scheduler_config.max_num_batched_tokens, self.max_model_len)
        blocks = cdiv(n, self.block_size) + 1
        caches = self._allocate_caches(blocks)
        table = np.arange(1, blocks, dtype=np.int32)[None, :]
        group_md = [b.profile(g.spec, table, n, self.build_ctx) if g.layers else None
                    for b, g in zip(self.builders, self.kv_cache_groups)]
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        received = None
        if not self.channel.is_first:
            zeros = torch.zeros(n, self.hidden_size, dtype=self.dtype, device=self.device)
            received = IntermediateTensors(zeros, zeros.clone() if self.sends_residual else None)
        out = self.model(ids, torch.as_tensor(np.arange(n), device=self.device), caches,
                         [group_md[g] for g in self.group_of_layer], intermediate=received)
        if not isinstance(out, IntermediateTensors):
            self.model.compute_logits(out[-1:])
        del caches, out
