"""The worker: one device, one model. Loads weights, sizes the KV cache, runs steps."""
from __future__ import annotations

import logging
import time
from typing import Any

import torch

from vllite_core.attention.kv_quant import configure_kv_scales
from vllite_core.config import ConfigError, VlliteConfig
from vllite_core.core.sched_output import SchedulerOutput
from vllite_core.executor.wrapper import ModelFacts
from vllite_core.platforms.interface import Platform
from vllite_core.worker.model_runner import ModelRunner, ModelRunnerOutput

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
        self.device = platform.device(self.tp.local_rank)
        self.runner: ModelRunner | None = None

    # Weights and caches are built as normal tensors even when the caller holds torch.inference_mode()
    # (``with torch.inference_mode(): LLM(...)``): inference tensors have no version counter, which the
    # platforms' packed-weight caches read to notice a changed weight.
    @torch.inference_mode(False)
    def load_model(self, source: Any, hf_config: Any, architecture: str, model_cls: type) -> None:
        """Build the model on the device and the runner around it (config must be finalized)."""
        from model_registry.loader import load_model
        from vllite_core.model_ops import use_model_ops

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
        self.runner.initialize_kv_cache(num_blocks)
        if self.tp.pp_size > 1:  # a stage's forward takes the previous stage's activations: no decode graphs yet
            return
        self.runner.model_forward.capture(self.platform, self.config, self.runner.kv_caches,
                                          len(self.runner.kv_cache_groups), self.runner.block_size,
                                          self.runner.max_model_len, self.device,
                                          any(g.spec.model_layout for g in self.runner.kv_cache_groups))

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        assert self.runner is not None
        return self.runner.execute_model(so)

    def model_facts(self) -> ModelFacts:
        """What the engine process needs of the model (only ids and sizes cross the executor)."""
        assert self.runner is not None
        r = self.runner
        lora = None
        if r.lora is not None:
            from vllite_core.lora.sharding import full_layout

            lora = full_layout(r.model)
        return ModelFacts(int(r.model.vocab_size), r.kv_cache_groups, r.kv_cache_dtype, lora)

    def remove_lora(self, lora_int_id: int) -> bool:
        assert self.runner is not None
        return self.runner.remove_lora(lora_int_id)
