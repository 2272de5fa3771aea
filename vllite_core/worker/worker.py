"""The worker: one device, one model. Loads weights, sizes the KV cache, runs steps."""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

import torch

from vllite_core.attention.kv_quant import configure_kv_scales
from vllite_core.config import ConfigError, VlliteConfig
from vllite_core.core.sched_output import SchedulerOutput
from vllite_core.engine.heap_trim import trim_heap
from vllite_core.executor.wrapper import ModelFacts
from vllite_core.platforms.interface import Platform
from vllite_core.worker.model_runner import ModelRunner, ModelRunnerOutput
from vllite_core.worker.sleep import (
    SleepReport,
    SleepState,
    check_level,
    check_tags,
    give_back_memory,
    mark_changed,
    model_tensors,
    offload_weights,
    restore_weights,
    tensor_bytes,
)

logger = logging.getLogger("vllite.worker")

_DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16, "fp16": torch.float16}


def resolve_dtype(name: str, platform: Platform) -> torch.dtype:
    if name == "auto":
        return platform.default_dtype()
    dtype = _DTYPES[name]
    if dtype not in platform.supported_dtypes():
        raise ConfigError(f"dtype: {name} is not supported on platform {platform.name!r} "
                          f"(supported: {[str(d).replace('torch.', '') for d in platform.supported_dtypes()]})")
    return dtype


class Worker:
    def __init__(self, config: VlliteConfig, platform: Platform, plugin_manager: Any) -> None:
        self.config = config
        self.platform = platform
        self.pm = plugin_manager
        from vllite_core.distributed import get_tp

        self.tp = get_tp()  # this process's rank (0 of 1 unless an executor made it one of several)
        # Pipeline stages whose caches differ: the engine's cache groups (align_kv_cache_groups), else None.
        self.stage_groups: list[Any] | None = None
        self.device = platform.device(self.tp.local_rank)
        self.runner: ModelRunner | None = None
        self.loaded: tuple[Any, Any, str, type] | None = None  # load_model's arguments: a level-2 wake reloads
        self.num_kv_blocks = 0
        self.sleep_state = SleepState()

    # Weights and caches are built as normal tensors even when the caller holds torch.inference_mode()
    # (``with torch.inference_mode(): LLM(...)``): inference tensors have no version counter, which the
    # platforms' packed-weight caches read to notice a changed weight.
    @torch.inference_mode(False)
    def load_model(self, source: Any, hf_config: Any, architecture: str, model_cls: type) -> None:
        """Build the model on the device and the runner around it (config must be finalized)."""
        from model_registry.loader import load_model
        from vllite_core.model_ops import use_model_ops

        self.loaded = (source, hf_config, architecture, model_cls)
        self.platform.init_device(self.config)
        self.platform.seed_everything(self.config.model_config.seed)
        dtype = resolve_dtype(self.config.model_config.dtype, self.platform)
        backend = self.platform.get_attention_backend(self.config)
        t0 = time.perf_counter()
        ops = self.platform.model_ops(self.config)
        with use_model_ops(ops):
            model = load_model(source, hf_config, model_cls, backend, dtype, self.device,
                               quantization=self.config.model_config.quantization)
        model.eval()
        # The loader's transient copies (checkpoint tensors, unpacked codes) are freed now; the C library keeps
        # freed heap pages (the CPU platform raises its trim threshold for activations' sake) unless asked.
        trim_heap()
        logger.info("loaded %s (%s, %s) in %.1fs, attention backend %s, model ops %s", architecture, dtype,
                    self.platform.name, time.perf_counter() - t0, backend.name, ops.name)
        from vllite_core.sample.logits_processor import load_logits_processors

        processors = load_logits_processors(self.config.model_config.logits_processors, self.pm)
        # The one place the cache dtype is decided: the platform maps kv_cache_dtype for the model dtype.
        kv_dtype = self.platform.kv_cache_torch_dtype(self.config.cache_config.kv_cache_dtype, dtype)
        configure_kv_scales(model, kv_dtype, self.config.cache_config.calculate_kv_scales)
        runner_cls: type[ModelRunner] = ModelRunner
        if self.tp.pp_size > 1:
            from vllite_core.worker.pp_runner import PipelineParallelModelRunner

            runner_cls = PipelineParallelModelRunner
        elif self.tp.world_size > 1:
            from vllite_core.worker.tp_runner import TensorParallelModelRunner

            runner_cls = TensorParallelModelRunner
        with use_model_ops(ops):  # the sampler keeps the platform's ops
            self.runner = runner_cls(self.config, model, backend, self.device, dtype, kv_dtype, processors)
        if self.stage_groups is not None:  # woken after sleep(level=2): the engine's groups, as before
            self.runner.align_kv_cache_groups(self.stage_groups)
        with use_model_ops(ops):  # the components' own models (a draft model, an EAGLE head)
            self.runner.load_models()

    def determine_num_kv_blocks(self) -> int:
        assert self.runner is not None
        cc = self.config.cache_config
        # Every group of one request at max_model_len (and the null block) must fit, or it would wait forever.
        max_len = self.config.model_config.max_model_len or 0
        need = sum(g.spec.max_blocks_per_request(max_len) for g in self.runner.kv_cache_groups) + 1
        if cc.num_kv_blocks is not None:
            # An override is trusted for the growing groups, but a request's fixed blocks (cross attention,
            # state) and one block of every other group must fit.
            fixed = sum(g.spec.max_blocks_per_request(max_len) if not g.spec.cacheable else 1
                        for g in self.runner.kv_cache_groups) + 1
            if cc.num_kv_blocks < fixed:
                raise ConfigError(f"num_kv_blocks: {cc.num_kv_blocks} blocks cannot hold one request: its fixed "
                                  f"cache blocks (cross attention, state) need {fixed}, the null block included")
            return cc.num_kv_blocks
        available = self.platform.determine_available_memory(self.config, self.runner.profile_run)
        num = int(available // self.runner.kv_cache_bytes_per_block())
        if num < need and not self.config.model_config.max_model_len_auto:  # auto: the engine fits the length
            raise ConfigError(f"kv cache: {available / 2**30:.2f} GiB holds {num} blocks, fewer than one "
                              f"max_model_len sequence needs ({need}); lower max_model_len or raise kv_cache_memory")
        return num

    @torch.inference_mode(False)
    def initialize_kv_cache(self, num_blocks: int) -> None:
        assert self.runner is not None
        self.num_kv_blocks = num_blocks
        self.runner.initialize_kv_cache(num_blocks)
        if self.config.cache_config.commit_kv_cache:
            self.runner.commit_kv_cache()
        if self.tp.pp_size > 1:  # a stage's forward takes the previous stage's activations: no decode graphs yet
            return
        self.runner.model_forward.capture(self.platform, self.config, self.runner.kv_caches,
                                          len(self.runner.kv_cache_groups), self.runner.block_size,
                                          self.runner.max_model_len, self.device,
                                          any(g.spec.model_layout for g in self.runner.kv_cache_groups))

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        assert self.runner is not None
        return self.runner.execute_model(so)

    def align_kv_cache_groups(self, per_tp_rank: list[list[Any]]) -> None:
        """Pipeline stages: the engine's cache groups (every stage's, for each tensor-parallel rank) replace this
        stage's own (pp_runner.py)."""
        assert self.runner is not None
        self.stage_groups = per_tp_rank[self.tp.rank]  # kept: a runner rebuilt after sleep(level=2) takes them too
        self.runner.align_kv_cache_groups(self.stage_groups)

    def model_facts(self) -> ModelFacts:
        """What the engine process needs of the model (only ids and sizes cross the executor)."""
        assert self.runner is not None
        r = self.runner
        lora = None
        if r.lora is not None:
            from vllite_core.lora.sharding import full_layout

            lora = full_layout(r.model)
        weights = sum(t.numel() * t.element_size() for t in (*r.model.parameters(), *r.model.buffers()))
        return ModelFacts(int(r.model.vocab_size), r.kv_cache_groups, r.kv_cache_dtype, lora, weights,
                          r.kv_cache_bytes_per_block())

    def remove_lora(self, lora_int_id: int) -> bool:
        assert self.runner is not None
        return self.runner.remove_lora(lora_int_id)

    # ---- sleep mode (worker/sleep.py) ---------------------------------------------------------------
    def sleep(self, level: int) -> SleepReport:
        """Release the KV cache (level 1) and the weights (level 2), giving the memory back; what was
        already released stays so. The engine core calls this only with no request in flight."""
        check_level(level)
        state = self.sleep_state
        kv = weights = 0
        if self.runner is not None and not state.kv_cache:
            kv = self.runner.release_kv_cache()
        state.kv_cache = True
        if level == 2 and self.runner is not None:
            weights = tensor_bytes(model_tensors(self.runner.model))
            self.runner = None  # the model, its packed weights, the batch state: rebuilt by wake_up
        elif level == 1 and not state.weights and self.device.type != "cpu" and self.runner is not None:
            offload_weights(self.runner.model)  # a host copy, as vLLM keeps (a CPU worker's stay put)
            weights = tensor_bytes(model_tensors(self.runner.model))
        state.weights = state.weights or weights > 0 or self.runner is None
        state.level = max(state.level, level)
        give_back_memory(self.platform)
        return SleepReport(kv, weights)

    @torch.inference_mode(False)
    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore the weights (reloaded from the checkpoint after level 2) and/or a fresh KV cache."""
        state = self.sleep_state
        for tag in check_tags(tags):
            if tag == "weights" and state.weights:
                if self.runner is None:
                    assert self.loaded is not None
                    self.load_model(*self.loaded)
                else:
                    restore_weights(self.runner.model, self.device)
                state.weights = False
            elif tag == "kv_cache" and state.kv_cache:
                if self.runner is None:
                    raise ValueError("tags: the KV cache cannot wake before the weights after sleep(level=2); "
                                     "wake 'weights' first (or both)")
                self.initialize_kv_cache(self.num_kv_blocks)
                state.kv_cache = False
        if not state.sleeping:
            state.level = 0

    def is_sleeping(self) -> bool:
        return self.sleep_state.sleeping

    # ---- weight updates (RLHF: new weights into a running engine) ------------------------------------
    @torch.inference_mode(False)
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | dict[str, torch.Tensor]) -> int:
        """Copy checkpoint-named tensors (an iterable of (name, tensor), or a state dict) into the running
        model; every rank slices its own shard. Returns how many parameters were filled. Unknown names and
        shape mismatches raise. The engine core forgets its cached prefixes after this (their K/V came from
        the old weights)."""
        if self.runner is None or self.sleep_state.weights:
            raise ValueError("load_weights: the weights are asleep; wake_up(tags=['weights']) first")
        from model_registry.layers.quantization import prequantized

        assert self.loaded is not None
        quantization = prequantized.resolve_quantization(self.loaded[1], self.config.model_config.quantization)
        if quantization is not None:
            raise ValueError(f"load_weights: the model is quantized ({quantization}); new weights cannot be copied "
                             "into its quantized layout")
        items = weights.items() if isinstance(weights, dict) else weights
        model = self.runner.model
        skip = getattr(model, "skips_weight", None)  # another pipeline stage's tensors
        loaded = model.load_weights((name, t.to(self.device)) for name, t in items if skip is None or not skip(name))
        mark_changed(model)
        return len(loaded)

    def reload_weights(self, path: str | None = None) -> int:
        """``load_weights`` from an HF checkpoint folder (None: the checkpoint the engine started with)."""
        from model_registry.loader import checkpoint_weights

        assert self.loaded is not None
        source, hf_config = self.loaded[0], self.loaded[1]
        return self.load_weights(checkpoint_weights(source, hf_config, path,
                                                    skip=getattr(self.runner.model, "skips_weight", None)))
