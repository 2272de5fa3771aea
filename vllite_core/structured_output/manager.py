"""StructuredOutputManager: picks each request's backend, compiles grammars off the step path, builds
the step's token bitmask and advances each request's matcher.

One per engine core, which builds it. The frontend calls ``BackendSelector.select`` while validating
a request (cheap, no tokenizer): the engine's backend, or under ``auto`` the first of xgrammar,
guidance, outlines that can take it; a request none can take is refused naming each backend's
reason. The core calls ``submit`` when the request is queued: the grammar compiles in a thread pool,
cached by (backend, kind, spec, options) (the tokenizer is the core's own, loaded with the first
grammar, so it is part of every key implicitly), and the request waits (``RequestStatus.WAITING_FOR_FSM``)
while the others run. Per step, ``grammar_bitmask`` writes one bitmask row per structured request
that samples; the scheduler calls ``RequestGrammar.accept`` with each token it appends.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from vllite_core.config import ConfigError, StructuredOutputsConfig
from vllite_core.sampling_params import SamplingParamsError, StructuredOutputsParams
from vllite_core.structured_output.backend import GrammarMatcher, UnsupportedGrammar, bitmask_words

if TYPE_CHECKING:
    from vllite_core.core.sched_output import SchedulerOutput
    from vllite_core.request import Request

logger = logging.getLogger("vllite.structured_output")

AUTO_ORDER = ("xgrammar", "guidance", "outlines")


def load_backend_classes(plugin_manager: Any) -> dict[str, type]:
    """Every backend registered through the hook (built-ins included), by name; first registration wins."""
    classes: dict[str, type] = {}
    for result in reversed(plugin_manager.hook.vllite_register_structured_output_backends()):
        for name, cls in (result or {}).items():
            classes.setdefault(name, cls)
    return classes


@dataclass
class GrammarBitmask:
    """The step's allowed tokens: ``bitmask[rows[req_id]]`` for each structured request that samples."""

    rows: dict[str, int]
    bitmask: torch.Tensor  # int32 [len(rows), ceil(vocab / 32)], on the host


class RequestGrammar:
    """One request's grammar: the compile it waits for, then its matcher."""

    def __init__(self, manager: "StructuredOutputManager", backend_name: str, params: StructuredOutputsParams,
                 future: Future, timeout_s: float, compile: "_CacheEntry") -> None:
        self.manager = manager
        self.backend_name = backend_name
        self.params = params
        self.future = future  # the request's own matcher, built in the pool after the compile
        self.timeout_s = timeout_s
        self._compile = compile.future  # the (maybe shared, maybe long finished) compile it needs
        self.compile_started = compile.started  # when that compile began: the timeout counts from there
        self.matcher: GrammarMatcher | None = None
        self.error: str | None = None
        self.jump_forward = manager.config.jump_forward
        # The allowed tokens at the matcher's position, when already known (filled to look for a forced
        # token): the step's bitmask copies this row instead of asking the backend again.
        self._mask: torch.Tensor | None = None
        self._mask_valid = False

    def poll(self) -> bool:
        """True once the matcher is ready; False while compiling. A failure sets ``error``."""
        if self.matcher is not None:
            return True
        if not self.future.done():
            # Only a compile still running can time out: a matcher queued behind other work waits (a
            # cached grammar's compile may have started long ago).
            start = self.compile_started.at
            if not self._compile.done() and start is not None and time.monotonic() - start > self.timeout_s:
                self.error = (f"structured_outputs.{self.params.kind}: the {self.backend_name} grammar did not "
                              f"compile in {self.timeout_s:g} s (compile_timeout_s)")
            return False
        exc = self.future.exception()
        if exc is None:
            self.matcher = self.future.result()
            return True
        self.error = f"structured_outputs.{self.params.kind}: {self.backend_name} cannot compile it: {exc}"
        return False

    def accept(self, token_id: int) -> bool:
        assert self.matcher is not None
        self._mask_valid = False
        return self.matcher.accept_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._mask_valid:
            bitmask[row] = self._mask[0]  # type: ignore[index]
        else:
            self.matcher.fill_bitmask(bitmask, row)  # type: ignore[union-attr]

    def forced_token(self) -> int | None:
        """The one token the grammar allows next (EOS included), or None when it allows several."""
        assert self.matcher is not None
        if self._mask is None:
            self._mask = torch.zeros(1, bitmask_words(self.manager.vocab_size), dtype=torch.int32)
        if not self._mask_valid:
            self._mask.zero_()  # a backend may only set the allowed bits
            self.matcher.fill_bitmask(self._mask, 0)
            self._mask_valid = True
        words = self._mask[0]
        nonzero = torch.nonzero(words)
        if nonzero.numel() != 1:
            return None
        i = int(nonzero[0, 0])
        w = int(words[i]) & 0xFFFFFFFF
        if w & (w - 1):
            return None
        return i * 32 + w.bit_length() - 1

    def is_terminated(self) -> bool:
        return self.matcher is not None and self.matcher.is_terminated()


@dataclass
class _Started:
    """When a compile left the pool's queue and began (None while queued): a compile's timeout
    counts its own time, not the compiles queued before it."""
    at: float | None = None


@dataclass
class _CacheEntry:
    future: Future
    started: _Started
    size: int = 0  # bytes, once compiled


def grammar_size(compiled: Any, spec: Any) -> int:
    """A compiled grammar's bytes: the backend's own count where it has one (xgrammar), else an
    estimate from the spec's length."""
    size = getattr(compiled, "memory_size_bytes", None)
    if isinstance(size, int) and size > 0:
        return size
    return 4096 + 64 * len(str(spec))


class BackendSelector:
    """Picks a request's grammar backend from the engine's config (no tokenizer): what a frontend needs to
    validate a request, and what the core's manager uses for a request that arrives unselected."""

    def __init__(self, config: StructuredOutputsConfig, plugin_manager: Any) -> None:
        self.config = config
        self.classes = load_backend_classes(plugin_manager)
        if config.backend == "auto":
            order = [n for n in AUTO_ORDER if n in self.classes] + [n for n in self.classes if n not in AUTO_ORDER]
        elif config.backend in self.classes:
            order = [config.backend]
        else:
            raise ConfigError(f"structured_outputs_config.backend: unknown backend {config.backend!r} "
                              f"(known: auto, {', '.join(self.classes)})")
        self.order = order

    def select(self, params: StructuredOutputsParams) -> str:
        """Choose the backend for a request (recorded on ``params``); SamplingParamsError naming the
        field, with each tried backend's reason, when none can take it."""
        auto = self.config.backend == "auto"
        fallback = auto and not (params.disable_fallback or self.config.disable_fallback)
        self._apply_engine_options(params)
        reasons = []
        for name in self.order if fallback else self.order[:1]:
            try:
                self.classes[name].check(params)
            except UnsupportedGrammar as e:
                reasons.append(f"{name}: {e}")
                continue
            params._backend, params._backend_was_auto = name, auto
            return name
        raise SamplingParamsError(f"structured_outputs.{params.kind}",
                                  "no structured output backend can compile it (" + "; ".join(reasons) + ")")

    def _apply_engine_options(self, params: StructuredOutputsParams) -> None:
        if self.config.disable_any_whitespace:
            params.disable_any_whitespace = True
        if self.config.disable_additional_properties:
            params.disable_additional_properties = True


class StructuredOutputManager:
    """The engine core's grammar compiler and bitmask builder. ``tokenizer`` None: ``load_tokenizer``
    gives (tokenizer, EOS id) when the first grammar compiles."""

    def __init__(self, config: StructuredOutputsConfig, tokenizer: Any, vocab_size: int,
                 eos_token_id: int | None, plugin_manager: Any,
                 load_tokenizer: Callable[[], tuple[Any, int | None]] | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._load_tokenizer = load_tokenizer
        self.selector = BackendSelector(config, plugin_manager)
        self.classes = self.selector.classes
        self.order = self.selector.order
        self._instances: dict[str, Any] = {}
        self._instance_lock = threading.Lock()
        # Compiled grammars by key, least recently used first, bounded by config.grammar_cache_bytes.
        self._cache: OrderedDict[tuple, _CacheEntry] = OrderedDict()
        self._cache_lock = threading.RLock()  # RLock: a compile done at once calls back under it
        self._pool: ThreadPoolExecutor | None = None
        self.num_compiles = 0  # grammars compiled (cache misses)
        self.num_cache_hits = 0
        self.num_cache_evictions = 0

    def select(self, params: StructuredOutputsParams) -> str:
        return self.selector.select(params)

    # ---- engine core ------------------------------------------------------------------
    def backend(self, name: str) -> Any:
        with self._instance_lock:
            inst = self._instances.get(name)
            if inst is None:
                if self.tokenizer is None and self._load_tokenizer is not None:
                    self.tokenizer, self.eos_token_id = self._load_tokenizer()
                inst = self.classes[name](self.tokenizer, self.vocab_size, self.eos_token_id)
                self._instances[name] = inst
            return inst

    def submit(self, params: StructuredOutputsParams) -> RequestGrammar:
        """Start (or reuse) the compile of a request's grammar; the result is the request's RequestGrammar."""
        name = params._backend or self.select(params)
        spec = getattr(params, params.kind)
        key = (name, params.kind, tuple(spec) if isinstance(spec, list) else spec, params.disable_any_whitespace,
               params.disable_additional_properties, params.whitespace_pattern)
        with self._cache_lock:
            entry = self._cache.get(key)
            if entry is None or (entry.future.done() and entry.future.exception() is not None):
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.config.max_compile_threads,
                                                    thread_name_prefix="vllite-grammar")
                started = _Started()
                entry = _CacheEntry(self._pool.submit(self._compile, name, params, started), started)
                self._cache[key] = entry
                entry.future.add_done_callback(self._compiled)
                self.num_compiles += 1
            else:
                self.num_cache_hits += 1
            self._cache.move_to_end(key)
            self._evict()
            # The request's own matcher is built in the pool too (llguidance compiles per matcher): tasks
            # run in submission order, so the compile it waits for has started already (no deadlock).
            matcher = self._pool.submit(self._matcher, name, entry.future)
        return RequestGrammar(self, name, params, matcher, self.config.compile_timeout_s, entry)

    def _compiled(self, _: Future) -> None:
        with self._cache_lock:  # a finished compile has its size now: within the bound again
            self._evict()

    def _evict(self) -> None:
        """Drop least recently used compiled grammars until the cache is within its byte bound
        (compiles still running stay: requests wait on them). Under ``_cache_lock``."""
        for key, e in list(self._cache.items()):
            if self.cache_bytes <= self.config.grammar_cache_bytes:
                return
            if e.future.done():
                del self._cache[key]
                self.num_cache_evictions += 1

    @property
    def cache_bytes(self) -> int:
        """Bytes of the compiled grammars the cache holds (/metrics: vllite:grammar_cache_bytes)."""
        total = 0
        for key, e in list(self._cache.items()):
            if e.future.done() and e.future.exception() is None:
                if not e.size:
                    e.size = grammar_size(e.future.result(), key[2])
                total += e.size
        return total

    def _compile(self, name: str, params: StructuredOutputsParams, started: _Started) -> Any:
        started.at = time.monotonic()
        return self.backend(name).compile(params)

    def _matcher(self, name: str, compiled: Future) -> GrammarMatcher:
        return self.backend(name).matcher(compiled.result())

    def wait_any(self, grammars: list[RequestGrammar], timeout: float) -> None:
        """Block up to ``timeout`` until one of the pending compiles finishes (the engine has nothing else)."""
        pending = [g.future for g in grammars if not g.future.done()]
        if pending:
            wait_futures(pending, timeout=timeout, return_when="FIRST_COMPLETED")

    def grammar_bitmask(self, requests: dict[str, "Request"], so: "SchedulerOutput") -> GrammarBitmask | None:
        """Bitmask rows for the structured requests that sample in this step (their last known token is
        scheduled), in schedule order; None when there are none."""
        sampling = []
        for rid, n in so.num_scheduled_tokens.items():
            req = requests.get(rid)
            g = getattr(req, "structured_output", None)
            if g is not None and g.matcher is not None and req.num_computed_tokens >= req.num_tokens:
                sampling.append((rid, g))
        if not sampling:
            return None
        bitmask = torch.zeros(len(sampling), bitmask_words(self.vocab_size), dtype=torch.int32)
        rows = {}
        for i, (rid, g) in enumerate(sampling):
            g.fill_bitmask(bitmask, i)
            rows[rid] = i
        return GrammarBitmask(rows, bitmask)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
