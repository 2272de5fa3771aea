"""Typed engine configuration.

Each dataclass holds one concern; `VlliteConfig` bundles them and applies the
cross-field rules (post-init) that vLLM applies: chunked prefill needs
``max_num_batched_tokens >= block_size``, without chunked prefill the budget must
hold a whole prompt, and so on. Platforms get a last word through
``Platform.check_and_update_config``.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from vllite_core.config.speculative import SpeculativeConfig
from vllite_core.errors import ConfigError
from vllite_core.model_interfaces import ModelCapabilities
from vllite_core.multimodal.config import MultiModalConfig

logger = logging.getLogger("vllite.config")

LogprobsMode = Literal["raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"]
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")
SchedulerPolicy = Literal["fcfs", "priority"]


# model_registry.layers.quantization: int8 and gguf at load; the others name a pre-quantized checkpoint's format
QUANTIZATION_METHODS = ("int8", "gguf", "compressed-tensors", "fp8", "gptq", "awq")
MODEL_IMPLS = ("auto", "vllite", "transformers")  # model_registry.model_impl


AUTO_MAX_MODEL_LEN = -1  # max_model_len -1 / "auto": the model's length, or what the KV cache holds if less
DEFAULT_MAX_MODEL_LEN = 2048  # vLLM's assumption for a config that names no context length
_SUFFIXES = {"k": 1000, "m": 1000**2, "g": 1000**3, "K": 1024, "M": 1024**2, "G": 1024**3}


def parse_max_model_len(value: Any) -> int | None:
    """vLLM's forms: an int, -1 or "auto", or a human-readable count ("1k" = 1000, "1K" = 1024, "25.6k")."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    if isinstance(value, str):
        text = value.strip()
        if text.lower() == "auto":
            return AUTO_MAX_MODEL_LEN
        try:
            if text[-1:] in _SUFFIXES:
                return int(float(text[:-1]) * _SUFFIXES[text[-1]])
            return int(text)
        except ValueError:
            pass
    raise ConfigError(f"max_model_len: expected a token count (e.g. 4096, 8k, 32K), -1 or 'auto'; got {value!r}")


@dataclass
class ModelConfig:
    """What to load. ``model=None`` means the embedded default model."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    # None: from the model's config (DEFAULT_MAX_MODEL_LEN, with a warning, when it names none); -1 or "auto":
    # that length, lowered to what the KV cache holds when it holds less (vLLM's --max-model-len auto).
    max_model_len: int | str | None = None
    max_model_len_auto: bool = False  # set from max_model_len -1 / "auto"
    seed: int = 0
    logprobs_mode: LogprobsMode = "raw_logprobs"
    max_logprobs: int = 20  # most top-k logprobs a request may ask for
    logits_processors: list[str] = field(default_factory=list)  # "module:attr" global processors
    trust_remote_code: bool = False
    # vLLM's hf_overrides: attributes set on the transformers config after it is read (e.g. a Qwen3-Reranker's
    # {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
    # "is_original_qwen3_reranker": true}); top-level keys replace the config's values.
    hf_overrides: dict[str, Any] | None = None
    # Hub repos (model_registry.hub): which revision, which cache folder, which one GGUF file.
    revision: str | None = None
    download_dir: str | None = None
    gguf_file: str | None = None
    # Default sampling parameters: "auto" (the model's generation_config.json), "vllite" (or vLLM's "vllm":
    # none), or a folder holding a generation_config.json.
    generation_config: str = "auto"
    runner: str = "auto"  # auto | generate | pooling (vLLM's --runner)
    convert: str = "auto"  # auto | none | embed | classify | reward: a causal LM used as a pooling model
    # auto | vllite | transformers (vLLM's --model-impl): a native class, or the Transformers fallback
    # (model_registry.model_impl); auto: native when one is registered.
    model_impl: str = "auto"
    # None (what config.json's quantization_config names, else none) | "int8" (W8A8) | "gguf" (GGUF blocks kept) |
    # "compressed-tensors" | "fp8" | "gptq" | "awq" (must match the checkpoint's): model_registry.layers.quantization
    quantization: str | None = None
    # sleep(level)/wake_up() may release and restore the KV cache and the weights (vLLM's enable_sleep_mode;
    # docs/sleep_mode.md).
    enable_sleep_mode: bool = False
    pooler_config: Any = None  # vllite_core.pooling.PoolerConfig of a pooling model; set when the engine starts
    # What the resolved model class declares (vllite_core.model_interfaces); set when the engine starts.
    capabilities: ModelCapabilities = field(default_factory=ModelCapabilities)

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16", "half", "float", "bf16", "fp32", "fp16"):
            raise ConfigError(f"dtype: unknown value {self.dtype!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError(f"logprobs_mode: must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        self.max_model_len = parse_max_model_len(self.max_model_len)
        if self.max_model_len == AUTO_MAX_MODEL_LEN:
            self.max_model_len_auto = True
        if self.max_model_len is not None and self.max_model_len <= 0 and self.max_model_len != AUTO_MAX_MODEL_LEN:
            raise ConfigError("max_model_len: must be positive, or -1 / 'auto'")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ConfigError(f"quantization: must be one of {', '.join(QUANTIZATION_METHODS)}, "
                              f"got {self.quantization!r}")
        if self.model_impl not in MODEL_IMPLS:
            raise ConfigError(f"model_impl: must be one of {', '.join(MODEL_IMPLS)}, got {self.model_impl!r}")
        if self.hf_overrides is not None and not (isinstance(self.hf_overrides, dict)
                                                  and all(isinstance(k, str) for k in self.hf_overrides)):
            raise ConfigError("hf_overrides: must be a dict of config attribute names to values")
        gc = self.generation_config
        if gc not in ("auto", "vllite", "vllm") and not os.path.isdir(os.path.expanduser(gc)):
            raise ConfigError(f"generation_config: must be 'auto', 'vllite' (or 'vllm') or a folder holding "
                              f"generation_config.json, got {gc!r}")


@dataclass
class CacheConfig:
    """Paged KV cache: block geometry, how many blocks, prefix caching."""

    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # auto (= model dtype) | fp8 variants where a platform supports them
    calculate_kv_scales: bool = False  # float8 caches: k/v scales from the first batch, not 1.0 or the checkpoint's
    num_kv_blocks: int | None = None  # override of the profiled number (alias: num_gpu_blocks_override)
    kv_cache_memory: int | None = None  # bytes for the KV cache (overrides memory_utilization)
    memory_utilization: float = 0.9  # fraction of device memory the engine may use (gpu_memory_utilization)
    commit_kv_cache: bool = False  # write every KV cache page at start-up: a fixed footprint from the start

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size: must be a positive power of two, got {self.block_size}")
        if not 0.0 < self.memory_utilization <= 1.0:
            raise ConfigError(f"memory_utilization: must be in (0, 1], got {self.memory_utilization}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ConfigError("num_kv_blocks: must be positive")


@dataclass
class SchedulerConfig:
    """The unified token-budget scheduler."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    policy: SchedulerPolicy = "fcfs"
    # Concurrent partial prefills: a prompt with more than `long_prefill_token_threshold` tokens left is
    # "long"; at most `max_num_partial_prefills` long prompts prefill in a step, each capped at the
    # threshold until the other requests had their share of the budget (the leftover tops them up).
    max_num_partial_prefills: int = 1
    long_prefill_token_threshold: int | None = None  # None: 4% of max_model_len; 0: no cap

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "priority"):
            raise ConfigError(f"scheduling_policy: must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.max_num_batched_tokens <= 0:
            raise ConfigError("max_num_batched_tokens: must be positive")
        if self.max_num_seqs <= 0:
            raise ConfigError("max_num_seqs: must be positive")
        if self.max_num_partial_prefills < 1:
            raise ConfigError("max_num_partial_prefills: must be >= 1")
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 0:
            raise ConfigError("long_prefill_token_threshold: must be >= 0 (0 turns the cap off)")


@dataclass
class DeviceConfig:
    """Which platform to run on; None resolves through the plugin manager."""

    device: str | None = None
    num_threads: int | None = None  # CPU platforms: torch threads (None: all cores)


@dataclass
class StructuredOutputsConfig:
    """Structured output for the whole engine (vLLM's names): one backend (``auto``: xgrammar, falling
    back to guidance then outlines for what the first cannot compile), compiled off the step path."""

    backend: str = "auto"  # auto | xgrammar | guidance | outlines | a plugin's backend
    compile_timeout_s: float = 30.0  # a grammar still compiling after this fails its request
    max_compile_threads: int = 2
    grammar_cache_bytes: int = 256 << 20  # compiled grammars kept for reuse, least recently used dropped first
    disable_fallback: bool = False  # auto: never fall back to another backend
    disable_any_whitespace: bool = False  # JSON: no free whitespace (every request)
    disable_additional_properties: bool = False
    # Beyond vLLM: where the grammar allows exactly one token, append it without a sampling step
    # (vllite_core/structured_output/jump_forward.py).
    jump_forward: bool = False

    KEYS = ("backend", "compile_timeout_s", "max_compile_threads", "grammar_cache_bytes", "disable_fallback",
            "disable_any_whitespace", "disable_additional_properties", "jump_forward")

    @classmethod
    def from_value(cls, value: Any) -> "StructuredOutputsConfig":
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"structured_outputs_config: must be a dict, got {type(value).__name__}")
        unknown = [k for k in value if k not in cls.KEYS]
        if unknown:
            raise ConfigError(f"structured_outputs_config: unknown key {unknown[0]!r} (known: {', '.join(cls.KEYS)})")
        cfg = cls(**value)
        if not isinstance(cfg.backend, str) or not cfg.backend:
            raise ConfigError("structured_outputs_config.backend: must be a backend name")
        if not cfg.compile_timeout_s > 0:
            raise ConfigError("structured_outputs_config.compile_timeout_s: must be > 0")
        if not isinstance(cfg.grammar_cache_bytes, int) or cfg.grammar_cache_bytes < 0:
            raise ConfigError("structured_outputs_config.grammar_cache_bytes: must be an integer >= 0")
        if not isinstance(cfg.max_compile_threads, int) or cfg.max_compile_threads < 1:
            raise ConfigError("structured_outputs_config.max_compile_threads: must be an integer >= 1")
        return cfg


@dataclass
class LoRAConfig:
    """Multi-LoRA serving (vllite_core/lora): device slots, CPU cache, largest rank."""

    max_loras: int = 1  # distinct adapters in one step (device slots)
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # loaded adapters kept in host memory (None: max_loras)

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ConfigError(f"max_loras: must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ConfigError(f"max_lora_rank: must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"max_cpu_loras: {self.max_cpu_loras} is less than max_loras={self.max_loras}")


EXECUTOR_BACKENDS = ("uni", "mp", "ray")


@dataclass
class ParallelConfig:
    """How the model is spread over processes (vLLM's names): ``tensor_parallel_size`` ranks per pipeline
    stage, ``pipeline_parallel_size`` stages (each owning a contiguous block of layers), one worker per rank,
    run by ``distributed_executor_backend``: ``uni`` (the worker in the engine's process), ``mp`` (one process
    per rank on this machine) or ``ray`` (Ray actors, across a Ray cluster's nodes). None picks ``uni`` for
    one rank, ``mp`` for more. Global rank = stage * tensor_parallel_size + tensor-parallel rank (vLLM's order).
    ``enable_expert_parallel``: a mixture of experts places whole experts on the tensor-parallel ranks (an
    equal share each) instead of splitting every expert's width over them; the rest stays tensor-parallel."""

    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            n = getattr(self, name)
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ConfigError(f"{name}: must be an integer >= 1, got {n!r}")
        world = self.world_size
        backend = self.distributed_executor_backend
        if backend is None:
            self.distributed_executor_backend = "uni" if world == 1 else "mp"
        elif backend not in EXECUTOR_BACKENDS:
            raise ConfigError(f"distributed_executor_backend: must be one of {', '.join(EXECUTOR_BACKENDS)}, "
                              f"got {backend!r}")
        elif backend == "uni" and world > 1:
            field_name = "tensor_parallel_size" if self.pipeline_parallel_size == 1 else "pipeline_parallel_size"
            raise ConfigError(f"distributed_executor_backend: 'uni' runs one worker, but {field_name} needs "
                              f"{world} (tensor_parallel_size={self.tensor_parallel_size} x pipeline_parallel_size="
                              f"{self.pipeline_parallel_size}); use 'mp' or 'ray'")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass
class VlliteConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    enforce_eager: bool = False
    lora_config: LoRAConfig | None = None  # None: LoRA off
    multimodal_config: MultiModalConfig = field(default_factory=MultiModalConfig)
    speculative_config: SpeculativeConfig | None = None  # None: no speculative decoding
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)

    def finalize(self, max_model_len: int) -> None:
        """Apply the cross-field rules once the model's context length is known."""
        mc, cc, sc = self.model_config, self.cache_config, self.scheduler_config
        mc.max_model_len = max_model_len
        caps = mc.capabilities
        if caps.is_encoder_decoder:
            if sc.enable_chunked_prefill or cc.enable_prefix_caching:
                logger.warning("encoder-decoder model: chunked prefill and prefix caching are turned off")
            sc.enable_chunked_prefill = False
            cc.enable_prefix_caching = False
        if caps.is_stateful and cc.enable_prefix_caching:
            logger.warning("a model with recurrent state cannot be prefix-cached: prefix caching is turned off")
            cc.enable_prefix_caching = False
        if not sc.enable_chunked_prefill and sc.max_num_batched_tokens < max_model_len:
            logger.info("chunked prefill off: max_num_batched_tokens raised to max_model_len=%d", max_model_len)
            sc.max_num_batched_tokens = max_model_len
        if sc.max_num_batched_tokens < sc.max_num_seqs and sc.enable_chunked_prefill:
            # One token per running request must fit in a step.
            sc.max_num_seqs = sc.max_num_batched_tokens
        if self.speculative_config is not None:
            why = ("an encoder-decoder model" if caps.is_encoder_decoder else "a model with recurrent state"
                   if caps.is_stateful else "a pooling model" if caps.is_pooling else None)
            if why:
                raise ConfigError(f"speculative_config: {why} cannot verify draft tokens (its per-request state "
                                  "cannot step back over rejected ones / it generates nothing)")


@dataclass
class EngineArgs:
    """Flat engine arguments with vLLM's names (CLI flags are these in kebab-case)."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | str | None = None  # also -1 / "auto" / "8k" (parse_max_model_len)
    seed: int = 0
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    scheduling_policy: str = "fcfs"
    max_num_partial_prefills: int = 1
    long_prefill_token_threshold: int | None = None
    logprobs_mode: str = "raw_logprobs"
    max_logprobs: int = 20
    logits_processors: list[str] = field(default_factory=list)
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    commit_kv_cache: bool = False
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    device: str | None = None
    num_threads: int | None = None
    trust_remote_code: bool = False
    hf_overrides: dict | None = None  # attributes set on the transformers config (vLLM's hf_overrides)
    revision: str | None = None
    download_dir: str | None = None
    gguf_file: str | None = None
    generation_config: str = "auto"
    runner: str = "auto"
    convert: str = "auto"
    model_impl: str = "auto"
    quantization: str | None = None
    enable_sleep_mode: bool = False
    structured_outputs_config: dict | None = None  # {"backend": "auto" | "xgrammar" | "guidance" | "outlines", ...}
    jump_forward: bool = False  # structured output: append grammar-forced tokens without sampling them
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Multimodal models (vllite_core.multimodal.MultiModalConfig).
    limit_mm_per_prompt: dict | str | None = None
    allowed_media_domains: list[str] = field(default_factory=list)  # http(s) image URLs from these ("*": any)
    media_fetch_timeout: float = 5.0
    max_media_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 4096 * 4096
    encoder_cache_size: int | None = None
    speculative_config: dict | str | None = None  # {"method": "ngram", "num_speculative_tokens": 4, ...}
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # uni | mp | ray (None: uni for one rank, else mp)
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = False  # MoE: whole experts placed by rank over the tensor-parallel ranks

    ALIASES = {"num_gpu_blocks_override": "num_kv_blocks", "memory_utilization": "gpu_memory_utilization"}
    REJECTED = {
        "swap_space": "there is no KV swapping: a preempted request is recomputed (prefix caching makes that cheap)",
        "best_of": "best_of is removed: use n, or send several requests",
    }

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineArgs":
        known = {f.name for f in fields(cls)}
        out: dict[str, Any] = {}
        for key, value in kwargs.items():
            if key in cls.REJECTED:
                if value in (None, 0, 1) and key == "best_of":
                    continue
                if key == "swap_space" and not value:
                    continue
                raise ConfigError(f"{key}: {cls.REJECTED[key]}")
            key = cls.ALIASES.get(key, key)
            if key not in known:
                raise ConfigError(f"unknown engine argument {key!r}")
            out[key] = value
        return cls(**out)

    def _structured_outputs_config(self) -> StructuredOutputsConfig:
        cfg = StructuredOutputsConfig.from_value(self.structured_outputs_config)
        if self.jump_forward:
            cfg = replace(cfg, jump_forward=True)
        return cfg

    def create_config(self) -> VlliteConfig:
        return VlliteConfig(
            model_config=ModelConfig(model=self.model, tokenizer=self.tokenizer, dtype=self.dtype,
                                     max_model_len=self.max_model_len, seed=self.seed,
                                     logprobs_mode=self.logprobs_mode,  # type: ignore[arg-type]
                                     max_logprobs=self.max_logprobs,
                                     logits_processors=list(self.logits_processors or []),
                                     trust_remote_code=self.trust_remote_code, hf_overrides=self.hf_overrides,
                                     revision=self.revision,
                                     download_dir=self.download_dir, gguf_file=self.gguf_file,
                                     generation_config=self.generation_config, runner=self.runner,
                                     convert=self.convert, model_impl=self.model_impl,
                                     quantization=self.quantization, enable_sleep_mode=self.enable_sleep_mode),
            cache_config=CacheConfig(block_size=self.block_size, enable_prefix_caching=self.enable_prefix_caching,
                                     kv_cache_dtype=self.kv_cache_dtype,
                                     calculate_kv_scales=self.calculate_kv_scales, num_kv_blocks=self.num_kv_blocks,
                                     kv_cache_memory=self.kv_cache_memory, commit_kv_cache=self.commit_kv_cache,
                                     memory_utilization=self.gpu_memory_utilization),
            scheduler_config=SchedulerConfig(max_num_batched_tokens=self.max_num_batched_tokens,
                                             max_num_seqs=self.max_num_seqs,
                                             enable_chunked_prefill=self.enable_chunked_prefill,
                                             policy=self.scheduling_policy,  # type: ignore[arg-type]
                                             max_num_partial_prefills=self.max_num_partial_prefills,
                                             long_prefill_token_threshold=self.long_prefill_token_threshold),
            device_config=DeviceConfig(device=self.device, num_threads=self.num_threads),
            structured_outputs_config=self._structured_outputs_config(),
            enforce_eager=self.enforce_eager,
            lora_config=LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras) if self.enable_lora
            else None,
            multimodal_config=MultiModalConfig(
                limit_mm_per_prompt=self.limit_mm_per_prompt or {}, max_image_pixels=self.max_image_pixels,
                allowed_media_domains=list(self.allowed_media_domains or []),
                media_fetch_timeout=self.media_fetch_timeout, max_media_bytes=self.max_media_bytes,
                encoder_cache_size=self.encoder_cache_size),
            speculative_config=SpeculativeConfig.from_value(self.speculative_config),
            parallel_config=ParallelConfig(self.tensor_parallel_size, self.distributed_executor_backend,
                                           self.pipeline_parallel_size, self.enable_expert_parallel),
        )
