"""LLMEngine: the synchronous frontend. Validates and tokenizes requests, steps the core,
turns token ids into RequestOutputs."""
from __future__ import annotations

import itertools
import logging
from typing import Any, Callable, Iterable

from vllite_core.config import EngineArgs, VlliteConfig
from vllite_core.core.stats import SchedulerStats
from vllite_core.engine.core import EngineCore, encoder_cache_geometry, model_eos_token_id
from vllite_core.engine.core_client import EngineCoreClient, InprocClient
from vllite_core.engine.output_processor import OutputProcessor, child_request_ids
from vllite_core.errors import EngineDeadError, EngineSleepingError, InvalidRequestError, PromptTooLongError
from vllite_core.inputs import InputContext, ProcessedPrompt
from vllite_core.outputs import RequestOutput
from vllite_core.plugins.manager import get_plugin_manager
from vllite_core.pooling.params import PoolingParams
from vllite_core.pooling.requests import POOLING_SAMPLING, prepare_pooling_prompt
from vllite_core.request import Request, RequestStatus
from vllite_core.sampling_params import SamplingParams
from vllite_core.structured_output.manager import BackendSelector
from vllite_core.worker.sleep import SleepReport, check_level, check_mode

logger = logging.getLogger("vllite.engine")

PromptType = str | dict[str, Any]


class LLMEngine:
    def __init__(self, config: VlliteConfig, platform: Any = None, core: EngineCoreClient | None = None) -> None:
        """``core``: a client of an engine core that already runs (the API process passes an MPClient,
        whose cores live in their own processes); by default an in-process core is built here. Either way
        the config the core finalized (context length, KV blocks, model capabilities) is this engine's."""
        from model_registry.generation_config import load_generation_defaults
        from model_registry.source import load_tokenizer

        self.core: EngineCoreClient = core if core is not None else InprocClient(EngineCore(config, platform))
        info = self.core.info
        self.config = config = info.config
        self.model_info = info.model_info
        self.tokenizer = load_tokenizer(info.model_info.source, config.model_config.tokenizer)
        self.max_model_len = info.model_info.max_model_len
        # What the model can emit (part of every engine model's contract: nested configs such as
        # Florence-2's have no top-level vocab_size).
        self.vocab_size = info.vocab_size
        self.eos_token_id = model_eos_token_id(self.tokenizer, info.model_info.hf_config)
        gen = load_generation_defaults(info.model_info.source, config.model_config.generation_config)
        # The model's recommended sampling values (vLLM's get_diff_sampling_param) and the EOS ids its
        # generation config adds to the tokenizer's: they stop generation like stop_token_ids.
        self.default_sampling_params: dict[str, Any] = dict(gen.sampling)
        self.extra_eos_token_ids = [t for t in dict.fromkeys(gen.eos_token_ids) if t != self.eos_token_id]
        if self.default_sampling_params:
            logger.warning("Default sampling parameters have been overridden by the model's Hugging Face generation "
                           "config recommended from the model creator: %s. If this is not intended, relaunch with "
                           "`--generation-config vllite`.", self.default_sampling_params)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_id)
        self._ids = itertools.count()
        self.model_cls = info.model_cls
        self.input_context = InputContext(self.tokenizer, info.model_info.hf_config, info.model_info.source.path)
        self.dead: BaseException | None = None  # set when a step failed with a fault of no single request
        self.sleeping = False  # sleep mode: requests are refused until wake_up (docs/sleep_mode.md)
        # Which grammar backend takes a request (no tokenizer: the grammars compile in the core).
        self.grammar_backends = BackendSelector(config.structured_outputs_config, get_plugin_manager())
        self.lora_registry = None  # LoRARequest -> checked adapter (vllite_core/lora/registry.py)
        if config.lora_config is not None:
            from vllite_core.lora.registry import LoRARegistry

            self.lora_registry = LoRARegistry(info.lora_layout, config.lora_config)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args.create_config())

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation-config defaults (vLLM's ``get_default_sampling_params``)."""
        return SamplingParams(**self.default_sampling_params)

    # ---- requests ---------------------------------------------------------------------
    def process_prompt(self, prompt: PromptType | ProcessedPrompt,
                       ctx: InputContext | None = None) -> ProcessedPrompt:
        """Token ids for the decoder, plus encoder inputs where the model class defines process_prompt,
        plus a prompt dict's ``cache_salt``. An already processed prompt passes through; ``ctx`` lets
        another thread use its own tokenizer."""
        if isinstance(prompt, ProcessedPrompt):
            return prompt
        ctx = ctx or self.input_context
        salt = parse_cache_salt(prompt)
        caps = self.config.model_config.capabilities
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            self._check_multi_modal_data(prompt)
        if caps.processes_prompts:
            try:
                processed = self.model_cls.process_prompt(prompt, ctx)
            except (InvalidRequestError, ValueError, TypeError, KeyError) as e:
                if isinstance(e, InvalidRequestError):
                    raise
                raise InvalidRequestError("prompt", str(e)) from e
        else:
            text, ids = parse_prompt(prompt, ctx.tokenizer)
            processed = ProcessedPrompt(prompt_token_ids=ids, prompt=text)
        if salt is not None:
            processed.cache_salt = salt
        if processed.mm_features:
            self._check_mm_features(processed.mm_features)
        return processed

    def _check_multi_modal_data(self, prompt: dict) -> None:
        """Media for a model that takes none, or beyond the engine's limits: refused with the field named."""
        from vllite_core.multimodal.errors import MediaError
        from vllite_core.multimodal.images import check_mm_prompt

        caps = self.config.model_config.capabilities
        if caps.is_multimodal_decoder:
            check_mm_prompt(prompt, self.model_cls.supported_modalities, self.config.multimodal_config)
        elif not caps.processes_prompts:  # an encoder-decoder model's prompt processor reads its own media
            raise MediaError("multi_modal_data", f"{self.model_info.architecture} is a text-only model: it "
                             "does not take images")

    def _check_mm_features(self, features: list) -> None:
        """Images the encoder could never schedule would wait forever: refuse them now. Without chunked
        prefill a prompt's images must all fit one step."""
        from vllite_core.multimodal.errors import MediaError

        geometry = encoder_cache_geometry(self.config)
        if geometry is None:
            return
        budget = geometry[1]
        rows = [f.length for f in features]
        if not self.config.scheduler_config.enable_chunked_prefill:
            rows = [sum(rows)]
        if max(rows) > budget:
            # the budget is the smaller of the two: name the one that limits it
            limit = ("encoder_cache_size" if budget < self.config.scheduler_config.max_num_batched_tokens
                     else "max_num_batched_tokens")
            raise MediaError("multi_modal_data", f"{max(rows)} embedding rows of one media item do not fit the "
                             f"encoder budget of {budget} rows per step (raise {limit})")

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return parse_prompt(prompt, self.tokenizer)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams, tokenizer: Any = None) -> int:
        """Check a request against the model; returns its resolved max_tokens. Reads config, vocab size
        and params only (bad words are tokenized with ``tokenizer``, by default the engine's)."""
        if self.config.model_config.pooler_config is not None:
            raise InvalidRequestError("model", f"{self.model_info.architecture} is a pooling model (task "
                                      f"{self.config.model_config.pooler_config.task}): it does not generate text")
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("prompt", "the prompt is empty")
        if n >= self.max_model_len:
            raise PromptTooLongError(n, self.max_model_len)
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError("prompt_token_ids", f"token id {bad[0]} is out of range [0, {self.vocab_size})")
        max_lp = self.config.model_config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > max_lp:
                raise InvalidRequestError(name, f"{k} is more than the engine's max_logprobs={max_lp}")
        params.check_vocab(self.vocab_size)
        if params.structured_outputs is not None and params.structured_outputs._backend is None:
            self.grammar_backends.select(params.structured_outputs)
        if params.bad_words and not params.bad_words_token_ids:
            params.tokenize_bad_words(tokenizer or self.tokenizer, self.vocab_size)
        room = self.max_model_len - n
        return room if params.max_tokens is None else min(params.max_tokens, room)

    def prepare_request(self, prompt: PromptType | ProcessedPrompt, params: SamplingParams,
                        ctx: InputContext | None = None, lora_request: Any = None) -> tuple[ProcessedPrompt, int]:
        """Process and validate a prompt: (processed prompt, resolved max_tokens), or a typed request
        error. Uses ``ctx``'s tokenizer (default: the engine's), so another thread may call it. With
        ``PoolingParams`` it is a pooling request (``vllite_core.pooling``). ``lora_request`` (a
        LoRARequest) is resolved to its loaded, checked adapter here."""
        if isinstance(params, PoolingParams):
            if lora_request is not None:
                raise InvalidRequestError("lora_request", "LoRA adapters are not supported for pooling requests")
            return prepare_pooling_prompt(self, prompt, params, ctx), 1
        processed = self.process_prompt(prompt, ctx)
        max_tokens = self.validate(processed.prompt_token_ids, params, ctx.tokenizer if ctx is not None else None)
        if lora_request is not None:
            if self.lora_registry is None:
                raise InvalidRequestError("lora_request", "LoRA is not enabled on this engine (enable_lora=True)")
            processed.lora_adapter = self.lora_registry.resolve(lora_request)
        return processed, max_tokens

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None, lora_request: Any = None) -> str:
        """Check, process and validate a request, then queue it (``add_prepared_request``)."""
        params = params or SamplingParams()
        if self.sleeping:
            raise EngineSleepingError()
        if request_id is None:
            request_id = str(next(self._ids))
        if self.output_processor.has(request_id):
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        if priority != 0 and self.config.scheduler_config.policy != "priority":
            raise InvalidRequestError("priority", "priority is only supported with scheduling_policy='priority'")
        processed, max_tokens = self.prepare_request(prompt, params, lora_request=lora_request)
        return self.add_prepared_request(request_id, processed, params, max_tokens, priority, arrival_time)

    def add_prepared_request(self, request_id: str, processed: ProcessedPrompt, params: SamplingParams,
                             max_tokens: int, priority: int = 0, arrival_time: float | None = None,
                             streamed: bool = False) -> str:
        """Queue a request that ``prepare_request`` accepted (nothing is validated again): the caller has
        checked that ``request_id`` is new and ``priority`` allowed. ``n > 1`` fans out into n children.
        ``streamed``: the caller makes the deltas itself (AsyncLLM's streams coalesce outputs, so they need
        cumulative ones): an ``output_kind`` of DELTA is produced as CUMULATIVE here."""
        text, ids = processed.prompt, processed.prompt_token_ids
        if isinstance(params, PoolingParams):
            self.output_processor.add(request_id, text, ids, POOLING_SAMPLING, [request_id])
            self.core.add_request(Request(request_id, ids, POOLING_SAMPLING, priority=priority, max_tokens=1,
                                          cache_salt=processed.cache_salt, pooling_params=params,
                                          **({} if arrival_time is None else {"arrival_time": arrival_time})))
            return request_id
        params = self._with_model_eos(params)
        child_ids = child_request_ids(request_id, params.n)
        self.output_processor.add(request_id, text, ids, params, child_ids, cumulative_deltas=streamed)
        for i, cid in enumerate(child_ids):
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = _with_seed(params, params.seed + i)
            kw = {} if arrival_time is None else {"arrival_time": arrival_time}
            self.core.add_request(Request(cid, ids, child_params, eos_token_id=self.eos_token_id,
                                          priority=priority, max_tokens=max_tokens,
                                          encoder_inputs=processed.encoder_inputs,
                                          num_encoder_tokens=processed.num_encoder_tokens,
                                          cache_salt=processed.cache_salt, mm_features=processed.mm_features or [],
                                          **kw, **_lora_fields(processed)))
        return request_id

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            self.core.abort_requests(self.output_processor.abort(rid))

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def release_core(self, lost: frozenset[str] | None = None) -> None:
        """After the core died (``core.restartable``): forget every request (the caller failed them).
        ``lost``: only one data-parallel core died, holding these engine request ids: only their requests
        are forgotten (a parallel-sampling request's children on a live core are aborted there), the
        others go on. The core client starts the dead core(s) again (``start_dead``, ``poll_started``)."""
        if lost is None:
            for rid in list(self.output_processor.states):
                self.output_processor.abort(rid)
        self.core.drop_dead(keep_live=lost is not None)
        if lost is not None:
            for parent in self.parents_of(lost):
                self.core.abort_requests(self.output_processor.abort(parent))
        self.dead = None

    def restart_core(self, lost: frozenset[str] | None = None) -> None:
        """``release_core``, then start the dead core(s) and wait until they serve (raises what their
        start-up raised)."""
        self.release_core(lost)
        self.core.start_dead()
        while not self.core.poll_started(wait_s=0.2):
            pass

    def parents_of(self, request_ids: frozenset[str]) -> set[str]:
        """The requests (as added) the engine request ids belong to (a parallel-sampling child's parent)."""
        return {self.output_processor.child_to_parent.get(rid, rid) for rid in request_ids}

    def get_stats(self) -> SchedulerStats:
        """The core's numbers: running/waiting, KV usage, preemptions, prefix-cache hits, step times."""
        return self.core.stats()

    def get_num_unfinished_requests(self) -> int:
        return self.core.get_num_unfinished_requests()

    # ---- sleep mode, collective_rpc, weight updates (docs/sleep_mode.md) ---------------------------------
    def sleep(self, level: int = 1, mode: str = "abort") -> list[SleepReport]:
        """Release the KV cache (level 1) and the weights (level 2) of every worker; each rank's bytes.
        ``mode`` (vLLM's): "abort" aborts the requests added and not finished; "wait" needs none in flight
        (this engine runs only when stepped: step them to the end first)."""
        check_level(level)
        check_mode(mode)
        unfinished = list(self.output_processor.states)
        if mode == "abort" and unfinished:
            self.abort_request(unfinished)
        reports = self.core.sleep(level)
        self.sleeping = True
        return reports

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.core.wake_up(tags)
        self.sleeping = self.core.is_sleeping()

    def is_sleeping(self) -> bool:
        return self.core.is_sleeping()

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        return self.core.collective_rpc(method, args, kwargs)

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    def step(self, delta: bool = False) -> list[RequestOutput]:
        """One engine step. A request that fails alone comes back finished with ``finish_reason="error"``
        and ``error`` set on its completion; an exception here belongs to no request: it goes up, and
        the engine is dead (every later step raises EngineDeadError naming it)."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine died: a step failed with {self.dead!r}")
        try:
            core_outputs = self.core.step()
        except Exception as e:
            self.dead = e
            raise
        outputs, to_stop = self.output_processor.process(core_outputs, delta=delta)
        for cid in to_stop:
            self.core.finish_request(cid, RequestStatus.FINISHED_STOPPED)
        return outputs


    def _with_model_eos(self, params: SamplingParams) -> SamplingParams:
        """``params`` plus the generation config's extra EOS ids as stop token ids (vLLM's
        update_from_generation_config); the caller's object is not changed."""
        extra = [t for t in self.extra_eos_token_ids if t not in (params.stop_token_ids or ())]
        if not extra or params.ignore_eos:
            return params
        import dataclasses

        out = dataclasses.replace(params, stop_token_ids=list(params.stop_token_ids or ()) + extra)
        out.bad_words_token_ids = params.bad_words_token_ids
        return out


def parse_prompt(prompt: PromptType, tokenizer: Any) -> tuple[str | None, list[int]]:
    """A text prompt, {"prompt": text} or {"prompt_token_ids": [...]} -> (text, token ids)."""
    if isinstance(prompt, str):
        return prompt, list(tokenizer.encode(prompt, add_special_tokens=True))
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) for t in ids):
                raise InvalidRequestError("prompt_token_ids", "must be a list of integers")
            return prompt.get("prompt"), list(ids)
        if isinstance(prompt.get("prompt"), str):
            return prompt["prompt"], list(tokenizer.encode(prompt["prompt"], add_special_tokens=True))
    raise InvalidRequestError("prompt", f"must be a string or a dict with 'prompt_token_ids', got "
                              f"{type(prompt).__name__}")


def parse_cache_salt(prompt: Any) -> str | None:
    """A prompt dict's ``cache_salt``: a non-empty string (None or absent: no salt)."""
    if not isinstance(prompt, dict) or prompt.get("cache_salt") is None:
        return None
    salt = prompt["cache_salt"]
    if not isinstance(salt, str) or not salt:
        raise InvalidRequestError("cache_salt", f"must be a non-empty string, got {salt!r}")
    return salt


def _lora_fields(processed: ProcessedPrompt) -> dict[str, Any]:
    """A LoRA request's adapter (by name, id and path: the workers load it) and its prefix-cache identity
    (a digest of the adapter's files, checked here)."""
    adapter = processed.lora_adapter
    if adapter is None:
        return {}
    from vllite_core.lora.request import LoRARequest

    return {"lora_request": LoRARequest(adapter.name, adapter.int_id, adapter.path),
            "block_extra_keys": ("lora", adapter.content_hash)}


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    import dataclasses

    child = dataclasses.replace(params, seed=seed, n=1, best_of=None)
    child.bad_words_token_ids = params.bad_words_token_ids
    return child
