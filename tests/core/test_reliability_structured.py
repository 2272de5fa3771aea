"""Issue 58, rows 3-5 (offline): structured-output specs are bounded (depth, enum/const values,
alternatives; a typed error naming the field), a grammar's compile timeout counts its own compile
time (not the compiles queued before it), and the compiled-grammar cache stays under its byte
bound (least recently used dropped) with real xgrammar compiles of 40 distinct large regexes."""
from __future__ import annotations

import threading
import time

import pytest

from vllite_core.config import StructuredOutputsConfig
from vllite_core.plugins.manager import get_plugin_manager
from vllite_core.sampling_params import (
    MAX_ENUM_ENTRIES,
    MAX_SCHEMA_DEPTH,
    SamplingParamsError,
    StructuredOutputsParams,
)
from vllite_core.structured_output import StructuredOutputManager


@pytest.mark.parametrize("kw,field,why", [
    (dict(json="[" * 900 + "]" * 900), "structured_outputs.json", "nests"),
    (dict(json={"type": "object", "properties": {"a": {"enum": [f"v{i}" for i in range(MAX_ENUM_ENTRIES + 1)]}}}),
     "structured_outputs.json", "enum/const"),
    (dict(regex="|".join(f"w{i}" for i in range(MAX_ENUM_ENTRIES + 2))), "structured_outputs.regex", "alternatives"),
    (dict(regex="(" * (MAX_SCHEMA_DEPTH + 1) + "a" + ")" * (MAX_SCHEMA_DEPTH + 1)), "structured_outputs.regex", "nest"),
    (dict(grammar="root ::= " + " | ".join(f'"g{i}"' for i in range(MAX_ENUM_ENTRIES + 2))),
     "structured_outputs.grammar", "alternatives"),
])
def test_spec_limits_name_the_field(kw, field, why):
    with pytest.raises(SamplingParamsError) as e:
        StructuredOutputsParams(**kw)
    assert e.value.param == field and why in str(e.value)


def test_specs_within_the_limits_pass():
    nested = {"type": "object"}
    for _ in range(MAX_SCHEMA_DEPTH // 2 - 1):  # each level is two brackets deep: {"properties": {"x": ...}}
        nested = {"type": "object", "properties": {"x": nested}}
    StructuredOutputsParams(json=nested)
    StructuredOutputsParams(json={"enum": list(range(MAX_ENUM_ENTRIES))})
    StructuredOutputsParams(json='{"type": "string", "pattern": "[[[[[[[[\\\\]"}')  # brackets in strings: not depth
    StructuredOutputsParams(regex=r"\((a|b)\)")


class _Compiled:
    def __init__(self, size: int) -> None:
        self.memory_size_bytes = size


class _FakeBackend:
    """Compiles instantly, except a regex named in ``hold``, which waits for its event."""
    hold: dict[str, threading.Event] = {}

    def __init__(self, tokenizer, vocab_size, eos_token_id) -> None:
        pass

    @classmethod
    def check(cls, params) -> None:
        pass

    def compile(self, params):
        ev = self.hold.get(params.regex)
        if ev is not None:
            ev.wait(60)
        return _Compiled(400)

    def matcher(self, compiled):
        return compiled


def _manager(**cfg) -> StructuredOutputManager:
    m = StructuredOutputManager(StructuredOutputsConfig.from_value({"backend": "xgrammar", **cfg}), None, 512, None,
                                get_plugin_manager())
    m.classes = {"xgrammar": _FakeBackend}
    return m


def _wait(pred, timeout=60.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return False


def test_compile_timeout_counts_compile_time_only():
    """One compile thread: a slow grammar times out; the grammar queued behind it does not, however
    long it waited, and compiles once the thread is free."""
    release = threading.Event()
    _FakeBackend.hold = {"slow": release}
    m = _manager(max_compile_threads=1, compile_timeout_s=0.3)
    try:
        slow = m.submit(StructuredOutputsParams(regex="slow"))
        queued = m.submit(StructuredOutputsParams(regex="quick"))
        assert _wait(lambda: (slow.poll(), slow.error)[1] is not None)
        assert "did not compile in 0.3 s" in slow.error
        time.sleep(0.5)  # past the timeout for the queued one too, had the queue counted
        assert not queued.poll() and queued.error is None and queued.compile_started.at is None
        release.set()
        assert _wait(queued.poll) and queued.error is None
    finally:
        release.set()
        m.shutdown()


def test_cache_hit_queued_behind_a_slow_compile_does_not_time_out():
    """A grammar compiled long ago and asked for again: its matcher waits in the pool's queue behind a
    slow compile; the timeout belongs to compiles, so the old compile's start time must not fail it."""
    release = threading.Event()
    _FakeBackend.hold = {"slow": release}
    m = _manager(max_compile_threads=1, compile_timeout_s=0.3)
    try:
        assert _wait(m.submit(StructuredOutputsParams(regex="cached")).poll)
        time.sleep(0.5)  # the cached compile started longer ago than the timeout
        slow = m.submit(StructuredOutputsParams(regex="slow"))
        hit = m.submit(StructuredOutputsParams(regex="cached"))
        assert _wait(lambda: slow.compile_started.at is not None)
        assert not hit.poll() and hit.error is None  # queued behind the slow one, not timed out
        release.set()
        assert _wait(hit.poll) and hit.error is None
    finally:
        release.set()
        m.shutdown()


def test_cache_is_bounded_by_bytes_lru():
    _FakeBackend.hold = {}
    m = _manager(grammar_cache_bytes=1000)  # 400 bytes a grammar: two fit
    try:
        for i in range(6):
            g = m.submit(StructuredOutputsParams(regex=f"r{i}"))
            assert _wait(g.poll)
        m.submit(StructuredOutputsParams(regex="r5"))  # a hit: most recently used
        assert m.cache_bytes <= 1000 and m.num_cache_evictions >= 4
        before = m.num_compiles
        assert _wait(m.submit(StructuredOutputsParams(regex="r5")).poll) and m.num_compiles == before  # kept
        assert _wait(m.submit(StructuredOutputsParams(regex="r0")).poll) and m.num_compiles == before + 1  # evicted
    finally:
        m.shutdown()


def test_real_xgrammar_cache_stays_under_its_bound_after_40_large_regexes(tiny_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_path)
    bound = 2 << 20
    m = StructuredOutputManager(StructuredOutputsConfig.from_value({"backend": "xgrammar", "grammar_cache_bytes": bound,
                                                                    "max_compile_threads": 2}),
                                tok, len(tok), tok.eos_token_id, get_plugin_manager())
    try:
        sizes = []
        for i in range(40):
            regex = "(" + "|".join(f"k{i}x{j}" for j in range(2000)) + ")"
            g = m.submit(StructuredOutputsParams(regex=regex))
            assert _wait(g.poll, 120), g.error
            # the eviction runs as the compile finishes (its done callback), a moment after the matcher can be ready
            assert _wait(lambda: m.cache_bytes <= bound, 10), m.cache_bytes
            sizes.append(m.cache_bytes)
        assert m.num_cache_evictions > 0 and max(sizes) > 0
        print(f"grammar cache: {m.cache_bytes} bytes after 40 regexes (bound {bound}), "
              f"{m.num_cache_evictions} evicted")
    finally:
        m.shutdown()
