"""EngineCore: the busy loop's body. Schedule, run the model, update requests.

It knows nothing about text: it takes token-id requests and returns, per step,
the new token ids of each request and whether it finished. Frontends (the sync
LLMEngine, the async server engine) detokenize and shape outputs.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from vllite_core.config import AUTO_MAX_MODEL_LEN, DEFAULT_MAX_MODEL_LEN, ConfigError, VlliteConfig
from vllite_core.core.kv_cache_manager import KVCacheManager
from vllite_core.core.scheduler import Scheduler, SchedulerStats
from vllite_core.model_interfaces import model_capabilities
from vllite_core.pooling import setup as pooling_setup
from vllite_core.request import Request, RequestStatus
from vllite_core.state_cache import check_state_options, limit_max_num_seqs
from vllite_core.worker.model_runner import SampleLogprobs

logger = logging.getLogger("vllite.engine")


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[SampleLogprobs] | None = None
    prompt_logprobs: list[SampleLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    num_preemptions: int = 0
    error: str | None = None  # finish_reason "error": what went wrong (this request alone failed)
    pooling_output: Any = None  # a pooling request's result (it finishes with it, no token sampled)


@dataclass
class StepTimes:
    """Where a step's time went; the model's share should dominate."""

    schedule: float = 0.0
    execute: float = 0.0
    update: float = 0.0
    steps: int = 0
    tokens: int = 0

    def as_dict(self) -> dict[str, float]:
        total = self.schedule + self.execute + self.update
        return {"steps": self.steps, "tokens": self.tokens, "schedule_s": self.schedule, "execute_s": self.execute,
                "update_s": self.update, "overhead_fraction": (self.schedule + self.update) / total if total else 0.0}


@dataclass
class ModelInfo:
    source: Any
    hf_config: Any
    architecture: str
    max_model_len: int
    num_kv_blocks: int
    extra: dict = field(default_factory=dict)


def _derive_max_model_len(config: VlliteConfig, hf_config: Any, model_cls: Any = None) -> int:
    limit = None
    # a model that knows its own limit says it: an encoder-decoder's decoder positions differ from the encoder's,
    # RoBERTa's positions start after its padding index
    if model_cls is not None and hasattr(model_cls, "get_max_model_len"):
        limit = int(model_cls.get_max_model_len(hf_config))
    # A multimodal config nests its decoder's (get_text_config returns the config itself for a text model).
    text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    for key in () if limit else ("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length"):
        value = getattr(hf_config, key, None) or getattr(text_config, key, None)
        if value:
            limit = int(value)
            break
    asked = config.model_config.max_model_len
    if asked is None or asked == AUTO_MAX_MODEL_LEN:
        if limit is None:  # vLLM's default and warning (a Mamba2 config names no length)
            logger.warning("the model config names no context length (max_position_embeddings, n_positions, ...): "
                           "assuming %d tokens; pass max_model_len to change it", DEFAULT_MAX_MODEL_LEN)
            return DEFAULT_MAX_MODEL_LEN
        return limit
    if limit is not None and asked > limit:
        raise ConfigError(f"max_model_len: {asked} is larger than the model's context length ({limit})")
    return asked


def fit_max_model_len(config: VlliteConfig, groups: Any, num_blocks: int) -> int:
    """max_model_len lowered (to a multiple of the block size) until one request of that length fits in
    ``num_blocks`` (the null block aside), with a warning; unchanged when it fits already."""
    asked = config.model_config.max_model_len
    assert asked is not None

    def fits(n: int) -> bool:
        return sum(g.spec.max_blocks_per_request(n) for g in groups) + 1 <= num_blocks

    if fits(asked):
        return asked
    bs = config.cache_config.block_size
    lo, hi = 0, asked // bs  # lo blocks fit, hi do not (in block-size steps)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * bs) else (lo, mid)
    if lo == 0:
        raise ConfigError(f"max_model_len auto: the KV cache ({num_blocks} blocks) cannot hold one block of tokens")
    logger.warning("max_model_len auto: the KV cache holds %d blocks, not the model's %d tokens: max_model_len is "
                   "%d", num_blocks, asked, lo * bs)
    config.finalize(lo * bs)
    return lo * bs


def encoder_cache_geometry(config: VlliteConfig) -> tuple[int, int] | None:
    """(cache rows, rows per step) of a multimodal model's encoder cache: as many rows as the step budget
    unless configured (vLLM sizes both the encoder's step budget and its cache from max_num_batched_tokens).
    None for other models. The API process checks prompts against it without the engine's scheduler."""
    if not config.model_config.capabilities.is_multimodal_decoder:
        return None
    budget = config.scheduler_config.max_num_batched_tokens
    size = config.multimodal_config.encoder_cache_size or budget
    return size, min(size, budget)


def _encoder_cache(config: VlliteConfig) -> Any:
    geometry = encoder_cache_geometry(config)
    if geometry is None:
        return None
    from vllite_core.multimodal.encoder_cache import EncoderCacheManager

    return EncoderCacheManager(cache_size=geometry[0], budget=geometry[1])


class EngineCore:
    def __init__(self, config: VlliteConfig, platform: Any = None) -> None:
        from model_registry.model_impl import apply_fallback_rules, resolve_model_impl
        from model_registry.registry import build_registry
        from model_registry.source import load_hf_config, resolve_model_source
        from vllite_core.platforms.resolve import resolve_platform
        from vllite_core.plugins.manager import get_plugin_manager

        self.config = config
        pm = get_plugin_manager()
        if platform is None:
            platform = resolve_platform(config.device_config.device).platform
        self.platform = platform
        platform.check_and_update_config(config)
        pm.hook.vllite_check_config(config=config)
        proposer_factory = None
        if config.speculative_config is not None:  # an unknown method fails before any model is loaded
            from vllite_core.spec_decode.registry import resolve_proposer_factory

            proposer_factory = resolve_proposer_factory(config.speculative_config, pm)

        mc = config.model_config
        source = resolve_model_source(mc.model, mc.revision, mc.download_dir, mc.gguf_file)
        hf_config = load_hf_config(source, mc.trust_remote_code)
        if config.speculative_config is not None and hasattr(proposer_factory, "check_config"):
            proposer_factory.check_config(config.speculative_config, hf_config)  # a draft model: path, vocabulary
        impl = resolve_model_impl(build_registry(pm), hf_config, mc.model_impl, mc.trust_remote_code)
        apply_fallback_rules(config, impl)
        arch, model_cls = impl.architecture, impl.model_cls
        model_cls = pooling_setup.resolve_model_class(arch, model_cls, mc.runner, mc.convert)
        mc.capabilities = model_capabilities(model_cls)
        if mc.capabilities.is_stateful:
            check_state_options(config, arch)
        if mc.capabilities.is_pooling:
            pooling_setup.setup_pooling(config, source.path, hf_config, model_cls)
        if config.lora_config is not None and not config.model_config.capabilities.supports_lora:
            raise ConfigError(f"enable_lora: {arch} does not support LoRA adapters (its model class does not "
                              "declare SupportsLoRA)")
        from vllite_core.distributed.checks import check_parallel_config
        from vllite_core.executor import make_executor

        check_parallel_config(config, platform, arch, model_cls, hf_config)
        max_model_len = _derive_max_model_len(config, hf_config, model_cls)
        config.finalize(max_model_len)
        if mc.pooler_config is not None:
            pooling_setup.size_encoder_cache(config, mc.pooler_config)

        # The workers (one per tensor-parallel rank) run where the executor puts them.
        self.executor = make_executor(config, platform)
        try:
            self.executor.load_model(source, hf_config, arch, model_cls)
            num_blocks = self.executor.determine_num_kv_blocks()
            self.executor.initialize_kv_cache(num_blocks)
        except BaseException:
            self.executor.shutdown()
            raise
        self.worker = self.executor.driver_worker  # the in-process worker (uni executor), else None
        facts = self.executor.facts
        assert facts is not None
        if mc.max_model_len_auto:  # --max-model-len auto: what the cache holds, if less than the model's length
            max_model_len = fit_max_model_len(config, facts.kv_cache_groups, num_blocks)
        # What the model can emit (part of every engine model's contract: nested configs such as
        # Florence-2's have no top-level vocab_size).
        self.vocab_size = facts.vocab_size
        cc = config.cache_config
        groups = facts.kv_cache_groups
        sc = config.speculative_config
        lookahead = sc.num_speculative_tokens if sc is not None and getattr(proposer_factory, "needs_lookahead",
                                                                             False) else 0
        self.kv_cache_manager = KVCacheManager(num_blocks, cc.block_size, cc.enable_prefix_caching, max_model_len,
                                               groups=groups, num_lookahead_tokens=lookahead)
        cc.enable_prefix_caching = self.kv_cache_manager.enable_caching
        limit_max_num_seqs(config, groups, num_blocks)
        self.scheduler = Scheduler(config.scheduler_config, cc, self.kv_cache_manager, max_model_len,
                                   max_loras=config.lora_config.max_loras if config.lora_config else 0,
                                   encoder_cache=_encoder_cache(config),
                                   num_spec_tokens=config.speculative_config.num_speculative_tokens
                                   if config.speculative_config else 0)
        self.model_info = ModelInfo(source, hf_config, arch, max_model_len, num_blocks)
        self.model_cls = model_cls
        self.model_impl = impl
        self.step_times = StepTimes()
        # Set by the frontend, which owns the tokenizer (vllite_core.structured_output.StructuredOutputManager).
        self.structured_output: Any = None
        kinds = ", ".join(f"{g.spec.kind} x{len(g.layers)}" for g in groups)
        logger.info("engine ready: %s (model_impl: %s) on %s, max_model_len=%d, %d KV blocks of %d tokens "
                    "(%d tokens, %s cache), cache groups: %s, %s executor, tensor_parallel_size=%d", arch, impl.impl,
                    platform.name, max_model_len, num_blocks, cc.block_size, num_blocks * cc.block_size,
                    str(facts.kv_cache_dtype).replace("torch.", ""), kinds, self.executor.backend,
                    config.parallel_config.tensor_parallel_size)

    def lora_layout(self) -> tuple[dict, dict]:
        """(targets, in_features) of the model's LoRA layers in checkpoint coordinates: what an adapter is
        checked against (rank 0 reports it; vllite_core/lora/sharding.py)."""
        assert self.executor.facts is not None and self.executor.facts.lora_layout is not None
        return self.executor.facts.lora_layout

    def remove_lora(self, lora_int_id: int) -> None:
        """Every worker forgets the adapter (a later request with its id loads it again)."""
        self.executor.remove_lora(lora_int_id)

    def add_request(self, request: Request) -> None:
        so = request.sampling_params.structured_outputs
        if so is not None and self.structured_output is not None:
            request.structured_output = self.structured_output.submit(so)
            request.status = RequestStatus.WAITING_FOR_FSM
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        self.scheduler.finish_requests(request_id, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        t0 = time.perf_counter()
        so = self.scheduler.schedule()
        sched = self.scheduler
        if self.structured_output is not None:
            so.grammar_bitmask = self.structured_output.grammar_bitmask(sched.requests, so)
        t1 = time.perf_counter()
        if so.is_empty and not so.finished_req_ids and not so.preempted_req_ids and not sched.grammar_errors:
            self._wait_for_grammars()
            return []
        result = self.executor.execute_model(so)
        t2 = time.perf_counter()
        updated = self.scheduler.update_from_output(so, result.sampled_token_ids, result.failed,
                                                    result.pooler_output, result.spec_token_ids)
        errors = {**sched.grammar_errors, **result.failed}
        sched.grammar_errors = {}
        outputs = []
        for req in updated:
            new_ids = result.sampled_token_ids.get(req.request_id, [])
            new_lps = result.logprobs.get(req.request_id)
            outputs.append(EngineCoreOutput(
                request_id=req.request_id, new_token_ids=new_ids,
                new_logprobs=new_lps[:len(new_ids)] if new_lps is not None else None,
                prompt_logprobs=result.prompt_logprobs.get(req.request_id),
                finish_reason=req.status.finish_reason, stop_reason=req.stop_reason,
                num_cached_tokens=max(req.num_cached_tokens, 0), first_scheduled_time=req.first_scheduled_time,
                num_preemptions=req.num_preemptions, error=errors.get(req.request_id),
                pooling_output=result.pooler_output.get(req.request_id)))
        t3 = time.perf_counter()
        st = self.step_times
        st.schedule += t1 - t0
        st.execute += t2 - t1
        st.update += t3 - t2
        st.steps += 1
        st.tokens += so.total_num_scheduled_tokens
        return outputs

    def _wait_for_grammars(self) -> None:
        """Nothing to run: if requests wait for their grammars, sleep until one compiles (not a hot spin)."""
        if self.structured_output is None:
            return
        pending = [r.structured_output for r in self.scheduler.waiting
                   if r.status == RequestStatus.WAITING_FOR_FSM and r.structured_output is not None]
        if pending:
            self.structured_output.wait_any(pending, timeout=0.01)

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def shutdown(self) -> None:
        """Stop the workers (other processes / actors for the mp and ray executors)."""
        self.executor.shutdown()
