"""EngineCore: the busy loop's body. Schedule, run the model, update requests.

It knows nothing about text: it takes token-id requests and returns, per step,
the new token ids of each request and whether it finished. Frontends (the sync
LLMEngine, the async server engine) detokenize and shape outputs.
"""
from __future__ import annotations

import collections
import copy
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from vllite_core.config import AUTO_MAX_MODEL_LEN, DEFAULT_MAX_MODEL_LEN, ConfigError, VlliteConfig
from vllite_core.core.kv_cache_manager import KVCacheManager
from vllite_core.core.sched_output import SchedulerOutput
from vllite_core.core.scheduler import Scheduler
from vllite_core.core.stats import SchedulerStats, StepTimes
from vllite_core.errors import EngineSleepingError
from vllite_core.model_interfaces import ModelCapabilities, model_capabilities
from vllite_core.pooling import setup as pooling_setup
from vllite_core.request import Request, RequestStatus
from vllite_core.state_cache import check_state_options, limit_max_num_seqs
from vllite_core.structured_output.manager import StructuredOutputManager
from vllite_core.worker.model_runner import ModelRunnerOutput, SampleLogprobs
from vllite_core.worker.sleep import SleepReport, check_level, check_tags

if TYPE_CHECKING:
    from model_registry.model_impl import ModelImplChoice
    from vllite_core.executor.base import StepHandle

logger = logging.getLogger("vllite.engine")

# Worker methods that load new weights: the core forgets its cached prefixes after one runs.
WEIGHT_UPDATES = ("load_weights", "reload_weights")


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

    return EncoderCacheManager(cache_size=geometry[0], budget=geometry[1],
                               whole_items=config.model_config.capabilities.mm_items_bidirectional)


@dataclass
class ResolvedModel:
    """The checkpoint and the model class that serves it (what the executor loads)."""

    source: Any
    hf_config: Any
    architecture: str
    model_cls: type
    capabilities: ModelCapabilities
    impl: ModelImplChoice  # native or the Transformers fallback, and why


@dataclass
class MemoryReport:
    """The memory an engine core will really hold: its resident set after start-up plus the part of the
    KV cache not yet committed (pages of a cache in host memory are committed as blocks are first used,
    unless ``commit_kv_cache`` wrote them all at start). Per engine core (tensor-parallel: rank 0's)."""

    weights_bytes: int  # the model's parameters and buffers
    kv_cache_bytes: int  # the whole KV cache (every block)
    resident_bytes: int  # the core process's RSS when it became ready
    kv_in_host_memory: bool  # the cache counts towards the process's RSS (a cpu platform)
    kv_committed: bool  # written at start-up (commit_kv_cache): already in ``resident_bytes``

    @property
    def planned_bytes(self) -> int:
        """Host memory to plan for: what it holds plus what the KV cache will still commit."""
        pending = self.kv_cache_bytes if self.kv_in_host_memory and not self.kv_committed else 0
        return self.resident_bytes + pending


def _memory_report(config: VlliteConfig, platform: Any, facts: Any, num_blocks: int) -> MemoryReport:
    import psutil

    return MemoryReport(facts.weights_bytes, num_blocks * facts.kv_cache_bytes_per_block,
                        psutil.Process().memory_info().rss, platform.device_type == "cpu",
                        config.cache_config.commit_kv_cache)


@dataclass
class CoreInfo:
    """What a frontend needs from a running core, sent once when it is ready (the same record in-process)."""

    config: VlliteConfig  # the config the core finalized (context length, KV blocks, capabilities)
    model_info: ModelInfo
    model_cls: type  # prompt processing for encoder-decoder / multimodal models
    vocab_size: int
    lora_layout: Any  # (targets, in_features) for the frontend's adapter checks; None without LoRA
    platform: str
    parallel_layout: dict[str, Any]  # the executor's ranks, processes and devices
    memory: MemoryReport


def _checked_config(config: VlliteConfig, platform: Any, pm: Any) -> VlliteConfig:
    """A copy of ``config`` as the platform adjusts it and the plugins accept it (the caller's is untouched)."""
    config = copy.deepcopy(config)
    platform.check_and_update_config(config)
    pm.hook.vllite_check_config(config=config)
    return config


def _proposer_factory(config: VlliteConfig, pm: Any) -> Any:
    """The speculative proposer's factory; an unknown method fails before any model is loaded."""
    if config.speculative_config is None:
        return None
    from vllite_core.spec_decode.registry import resolve_proposer_factory

    return resolve_proposer_factory(config.speculative_config, pm)


def _resolve_model(config: VlliteConfig, pm: Any, proposer_factory: Any) -> ResolvedModel:
    """Find the checkpoint and its model class (native or the Transformers fallback, ``model_impl``); refuse a
    draft model, LoRA or a runner the class cannot serve."""
    from model_registry.model_impl import resolve_model_impl
    from model_registry.registry import build_registry
    from model_registry.source import load_hf_config, resolve_model_source

    mc = config.model_config
    source = resolve_model_source(mc.model, mc.revision, mc.download_dir, mc.gguf_file)
    hf_config = load_hf_config(source, mc.trust_remote_code, mc.hf_overrides)
    if getattr(hf_config, "classifier_from_token", None) is not None:
        from model_registry.source import load_tokenizer
        from vllite_core.pooling.from_token import resolve_classifier_tokens

        resolve_classifier_tokens(hf_config, load_tokenizer(source, mc.tokenizer, mc.trust_remote_code))
    if config.speculative_config is not None and hasattr(proposer_factory, "check_config"):
        proposer_factory.check_config(config.speculative_config, hf_config)  # a draft model: path, vocabulary
    impl = resolve_model_impl(build_registry(pm), hf_config, mc.model_impl, mc.trust_remote_code)
    arch = impl.architecture
    model_cls = pooling_setup.resolve_model_class(arch, impl.model_cls, mc.runner, mc.convert)
    caps = model_capabilities(model_cls)
    if getattr(hf_config, "classifier_from_token", None) is not None and not (
            getattr(model_cls, "uses_token_classifier", False) and model_cls.pooling_task in ("classify", "reward")):
        raise ConfigError(f"hf_overrides.classifier_from_token: {arch} is not a causal LM served as a classifier "
                          "(set architectures to its *ForSequenceClassification, e.g. Qwen3ForSequenceClassification)")
    if config.lora_config is not None and not caps.supports_lora:
        raise ConfigError(f"enable_lora: {arch} does not support LoRA adapters (its model class does not "
                          "declare SupportsLoRA)")
    return ResolvedModel(source, hf_config, arch, model_cls, caps, impl)


def _model_config(config: VlliteConfig, model: ResolvedModel, platform: Any) -> VlliteConfig:
    """A copy of ``config`` for this model: its capabilities, pooling rules and context length applied."""
    from model_registry.model_impl import apply_fallback_rules
    from vllite_core.distributed.checks import check_parallel_config

    config = copy.deepcopy(config)
    apply_fallback_rules(config, model.impl)
    mc = config.model_config
    mc.capabilities = model.capabilities
    if model.capabilities.is_stateful:
        check_state_options(config, model.architecture)
    if model.capabilities.is_pooling:
        pooling_setup.setup_pooling(config, model.source.path, model.hf_config, model.model_cls)
    check_parallel_config(config, platform, model.architecture, model.model_cls, model.hf_config)
    config.finalize(_derive_max_model_len(config, model.hf_config, model.model_cls))
    if mc.pooler_config is not None:
        pooling_setup.size_encoder_cache(config, mc.pooler_config)
    return config


def _start_executor(config: VlliteConfig, platform: Any, model: ResolvedModel) -> tuple[Any, int]:
    """The workers (one per tensor-parallel rank, where the executor puts them) with the model loaded and
    its KV cache allocated; (executor, number of KV blocks)."""
    from vllite_core.executor import make_executor

    executor = make_executor(config, platform)
    try:
        executor.load_model(model.source, model.hf_config, model.architecture, model.model_cls)
        num_blocks = executor.determine_num_kv_blocks()
        executor.initialize_kv_cache(num_blocks)
    except BaseException:
        executor.shutdown()
        raise
    return executor, num_blocks


def _kv_cache_manager(config: VlliteConfig, groups: list, num_blocks: int, proposer_factory: Any) -> KVCacheManager:
    cc, sc = config.cache_config, config.speculative_config
    lookahead = sc.num_speculative_tokens if sc is not None and getattr(proposer_factory, "needs_lookahead",
                                                                         False) else 0
    return KVCacheManager(num_blocks, cc.block_size, cc.enable_prefix_caching, config.model_config.max_model_len,
                          groups=groups, num_lookahead_tokens=lookahead)


def _cache_config(config: VlliteConfig, kv: KVCacheManager, groups: list, num_blocks: int) -> VlliteConfig:
    """A copy of ``config`` with what the KV cache allows: prefix caching only where every group can be
    cached, no more running requests than the state cache holds."""
    config = copy.deepcopy(config)
    config.cache_config.enable_prefix_caching = kv.enable_caching
    limit_max_num_seqs(config, groups, num_blocks)
    return config


def _scheduler(config: VlliteConfig, kv: KVCacheManager) -> Scheduler:
    sc = config.speculative_config
    return Scheduler(config.scheduler_config, config.cache_config, kv, config.model_config.max_model_len,
                     max_loras=config.lora_config.max_loras if config.lora_config else 0,
                     encoder_cache=_encoder_cache(config), num_spec_tokens=sc.num_speculative_tokens if sc else 0,
                     pipeline_parallel=config.parallel_config.pipeline_parallel_size > 1)


def _structured_output_manager(config: VlliteConfig, model: ResolvedModel, vocab_size: int,
                               pm: Any) -> StructuredOutputManager:
    """The core's grammar compiler. Its tokenizer loads with the first grammar: a core that serves no
    structured output request never loads one."""
    from model_registry.source import load_tokenizer

    def tokenizer() -> tuple[Any, int | None]:
        tok = load_tokenizer(model.source, config.model_config.tokenizer)
        return tok, model_eos_token_id(tok, model.hf_config)

    return StructuredOutputManager(config.structured_outputs_config, None, vocab_size, None, pm,
                                   load_tokenizer=tokenizer)


def model_eos_token_id(tokenizer: Any, hf_config: Any) -> int | None:
    """The tokenizer's EOS id, else the model config's (its first, when it lists several)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
        if isinstance(eos, (list, tuple)):
            eos = eos[0] if eos else None
    return eos


class EngineCore:
    """Schedule, run the model, update requests. Built from the config alone: it resolves the model,
    starts the workers and makes its own scheduler, KV cache manager and grammar compiler."""

    def __init__(self, config: VlliteConfig, platform: Any = None) -> None:
        from vllite_core.platforms.resolve import resolve_platform
        from vllite_core.plugins.manager import get_plugin_manager

        pm = get_plugin_manager()
        self.platform = platform if platform is not None else resolve_platform(config.device_config.device).platform
        config = _checked_config(config, self.platform, pm)
        proposer_factory = _proposer_factory(config, pm)
        model = _resolve_model(config, pm, proposer_factory)
        config = _model_config(config, model, self.platform)
        self.executor, num_blocks = _start_executor(config, self.platform, model)
        self.worker = self.executor.driver_worker  # the in-process worker (uni executor), else None
        facts = self.executor.facts
        assert facts is not None
        if config.model_config.max_model_len_auto:  # --max-model-len auto: what the cache holds, if less
            config = copy.deepcopy(config)
            fit_max_model_len(config, facts.kv_cache_groups, num_blocks)
        # What the model can emit (part of every engine model's contract: nested configs such as
        # Florence-2's have no top-level vocab_size).
        self.vocab_size = facts.vocab_size
        groups = facts.kv_cache_groups
        self.kv_cache_manager = _kv_cache_manager(config, groups, num_blocks, proposer_factory)
        self.config = config = _cache_config(config, self.kv_cache_manager, groups, num_blocks)
        self.scheduler = _scheduler(config, self.kv_cache_manager)
        # Steps in flight at once (vLLM's batch queue): one per pipeline stage; each entry is (the executor's
        # handle, the step, its scheduling time).
        self.batch_queue_size = self.executor.max_concurrent_batches
        self.batch_queue: collections.deque[tuple[StepHandle, SchedulerOutput, float]] = collections.deque()
        self.max_batches_in_flight = 0  # the most steps ever in flight together (what overlapped)
        self.structured_output = _structured_output_manager(config, model, self.vocab_size, pm)
        max_model_len = config.model_config.max_model_len
        self.model_info = ModelInfo(model.source, model.hf_config, model.architecture, max_model_len, num_blocks)
        self.model_cls = model.model_cls
        self.model_impl = model.impl
        self.step_times = StepTimes()
        self.memory = _memory_report(config, self.platform, facts, num_blocks)
        self.sleeping = False  # sleep mode: the workers released their KV cache (and maybe their weights)
        cc = config.cache_config
        kinds = ", ".join(f"{g.spec.kind} x{len(g.layers)}" for g in groups)
        logger.info("engine ready: %s (model_impl: %s) on %s, max_model_len=%d, %d KV blocks of %d tokens "
                    "(%d tokens, %s cache), cache groups: %s, %s executor, tensor_parallel_size=%d, "
                    "pipeline_parallel_size=%d",
                    model.architecture, model.impl.impl, self.platform.name,
                    max_model_len, num_blocks, cc.block_size, num_blocks * cc.block_size,
                    str(facts.kv_cache_dtype).replace("torch.", ""), kinds, self.executor.backend,
                    config.parallel_config.tensor_parallel_size, config.parallel_config.pipeline_parallel_size)
        m, gib = self.memory, 2 ** 30
        how = ("committed now: commit_kv_cache" if m.kv_committed else
               "committed as blocks are first used; commit_kv_cache commits it at start")
        logger.info("engine memory: weights %.2f GiB, KV cache %.2f GiB (%s); the process holds %.2f GiB now and "
                    "will hold up to %.2f GiB%s", m.weights_bytes / gib, m.kv_cache_bytes / gib,
                    how if m.kv_in_host_memory else "device memory", m.resident_bytes / gib,
                    m.planned_bytes / gib, " with its KV cache full" if m.kv_in_host_memory else "")

    def info(self) -> CoreInfo:
        return CoreInfo(self.config, self.model_info, self.model_cls, self.vocab_size,
                        self.lora_layout() if self.config.lora_config is not None else None, self.platform.name,
                        self.executor.layout, self.memory)

    def lora_layout(self) -> tuple[dict, dict]:
        """(targets, in_features) of the model's LoRA layers in checkpoint coordinates: what an adapter is
        checked against (rank 0 reports it; vllite_core/lora/sharding.py)."""
        assert self.executor.facts is not None and self.executor.facts.lora_layout is not None
        return self.executor.facts.lora_layout

    def remove_lora(self, lora_int_id: int) -> None:
        """Every worker forgets the adapter (a later request with its id loads it again)."""
        self.executor.remove_lora(lora_int_id)

    def add_request(self, request: Request) -> None:
        if self.sleeping:
            raise EngineSleepingError(f"request {request.request_id!r}")
        so = request.sampling_params.structured_outputs
        if so is not None:
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
        """One step: schedule, run, update. With pipeline stages, ``_step_with_batch_queue``."""
        if self.batch_queue_size > 1 or self.batch_queue:
            return self._step_with_batch_queue()
        t0 = time.perf_counter()
        so = self._schedule()
        t1 = time.perf_counter()
        if so is None:
            self._wait_for_grammars()
            return []
        result = self.executor.execute_model(so)
        t2 = time.perf_counter()
        return self._finish_step(so, result, t1 - t0, t2 - t1)

    def _step_with_batch_queue(self) -> list[EngineCoreOutput]:
        """vLLM V1's batch queue: while fewer than ``batch_queue_size`` steps are in flight, schedule another
        (the scheduler leaves out the requests already in flight) and return at once; otherwise, or when
        nothing more can be scheduled, wait for the oldest step and update from it. With M stages, stage 0
        runs the newest batch while the later stages run the older ones."""
        q = self.batch_queue
        t0 = time.perf_counter()
        if len(q) < self.batch_queue_size:
            so = self._schedule()
            if so is not None:
                q.append((self.executor.execute_model_async(so), so, time.perf_counter() - t0))
                self.max_batches_in_flight = max(self.max_batches_in_flight, len(q))
                if len(q) < self.batch_queue_size and not so.is_empty:
                    return []
        if not q:
            self._wait_for_grammars()
            return []
        handle, so, schedule_s = q.popleft()
        t1 = time.perf_counter()
        result = handle.result()
        return self._finish_step(so, result, schedule_s, time.perf_counter() - t1)

    def _schedule(self) -> SchedulerOutput | None:
        """The next step, or None when there is nothing to send the workers."""
        sched = self.scheduler
        so = sched.schedule()
        so.grammar_bitmask = self.structured_output.grammar_bitmask(sched.requests, so)
        if so.is_empty and not so.finished_req_ids and not so.preempted_req_ids and not sched.grammar_errors:
            return None
        return so

    def _finish_step(self, so: SchedulerOutput, result: ModelRunnerOutput, schedule_s: float,
                     execute_s: float) -> list[EngineCoreOutput]:
        """Update the requests from a step's output; their outputs."""
        t2 = time.perf_counter()
        sched = self.scheduler
        updated = sched.update_from_output(so, result.sampled_token_ids, result.failed,
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
        st = self.step_times
        st.schedule += schedule_s
        st.execute += execute_s
        st.update += time.perf_counter() - t2
        st.steps += 1
        st.tokens += so.total_num_scheduled_tokens
        return outputs

    def _wait_for_grammars(self) -> None:
        """Nothing to run: if requests wait for their grammars, sleep until one compiles (not a hot spin)."""
        pending = [r.structured_output for r in self.scheduler.waiting
                   if r.status == RequestStatus.WAITING_FOR_FSM and r.structured_output is not None]
        if pending:
            self.structured_output.wait_any(pending, timeout=0.01)

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (False when blocks are still held by requests)."""
        return self.kv_cache_manager.reset_prefix_cache()

    def stats(self) -> SchedulerStats:
        s = self.scheduler.stats(self.step_times)
        s.grammar_cache_bytes = self.structured_output.cache_bytes
        s.grammar_cache_evictions = self.structured_output.num_cache_evictions
        return s

    # ---- sleep mode, the user's RPCs, weight updates (docs/sleep_mode.md) ------------------------------
    def sleep(self, level: int = 1) -> list[SleepReport]:
        """Every worker releases its KV cache (level 1) and its weights (level 2); requests are refused
        until ``wake_up``. Only with no request in flight. Each rank's released bytes."""
        if not self.config.model_config.enable_sleep_mode:
            raise ConfigError("enable_sleep_mode: sleep() needs the engine started with enable_sleep_mode=True")
        check_level(level)
        if self.has_unfinished_requests():
            raise ValueError(f"sleep: {self.get_num_unfinished_requests()} request(s) are in flight; let them "
                             "finish (or abort them) first")
        reports = self.executor.sleep(level)
        self.sleeping = True
        self.kv_cache_manager.reset_prefix_cache()  # the cached blocks' K/V are gone
        logger.info("sleep(level=%d): released %.1f MiB of KV cache and %.1f MiB of weights", level,
                    sum(r.kv_cache_bytes for r in reports) / 2**20, sum(r.weight_bytes for r in reports) / 2**20)
        return reports

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what ``sleep`` released (``tags``: "weights", "kv_cache"; None: both)."""
        check_tags(tags)
        self.executor.wake_up(tags)
        self.sleeping = self.executor.is_sleeping()

    def is_sleeping(self) -> bool:
        return self.sleeping

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """``method`` (a worker method's name, or a function called with the worker first) on every rank;
        the results in rank order. After a weight update (``WEIGHT_UPDATES``) cached prefixes are forgotten:
        their K/V came from the old weights."""
        if callable(method):
            import cloudpickle

            payload: str | bytes = cloudpickle.dumps(method)
        elif isinstance(method, str):
            payload = method
        else:
            raise TypeError(f"method: a worker method's name or a function, got {type(method).__name__}")
        results = self.executor.run_on_workers(payload, tuple(args), dict(kwargs or {}))
        if method in WEIGHT_UPDATES and not self.reset_prefix_cache():
            logger.warning("%s: the prefix cache could not be reset (requests hold blocks computed with the old "
                           "weights)", method)
        return results

    def shutdown(self) -> None:
        """Stop the workers (other processes / actors for the mp and ray executors) and the grammar compiler."""
        self.structured_output.shutdown()
        self.executor.shutdown()
