"""SamplingParams: how one request is sampled and when it stops.

Names and defaults follow vLLM so users can switch. Validation happens here, at
construction, so a bad request fails before it reaches the engine.
"""
from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

GREEDY_EPS = 1e-5  # temperatures below this are greedy (argmax)

# Edge limits (docs/serving.md, "Request limits"). Every integer is an int64 (what torch and numpy
# hold; torch.Generator.manual_seed takes any int64 seed), every float finite; lists are bounded so
# that what the engine does per request and per step stays small. One place for all of them.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_N = 128  # completions per request (vLLM has no limit)
MAX_STOP_STRINGS = 128  # entries of ``stop``
MAX_STOP_STR_LEN = 1024  # characters of one stop string (streams hold back len - 1 characters)
MAX_STOP_TOKEN_IDS = 1024
MAX_BAD_WORDS = 1024
MAX_BAD_WORD_LEN = 1024  # characters of one bad word
MAX_LOGIT_BIAS = 4096  # entries of ``logit_bias``
MAX_ALLOWED_TOKEN_IDS = 1 << 17  # entries of ``allowed_token_ids`` (a vocabulary-sized list fits)
MAX_TEMPERATURE = 100.0  # far past uniform sampling already
MAX_REPETITION_PENALTY = 100.0
MAX_LOGIT_BIAS_VALUE = 100.0  # OpenAI's documented range: [-100, 100]

_INT_FIELDS = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "best_of")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


class SamplingParamsError(ValueError):
    """A sampling parameter is invalid; ``param`` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


# The kinds of constraint one StructuredOutputsParams may carry (exactly one per request).
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
MAX_CHOICES = 1024
MAX_GRAMMAR_SPEC_LEN = 256 << 10  # characters of a schema, regex, grammar or structural tag
# Compile cost grows with these, far faster than with length (a 22 KB schema nested 900 deep, a
# 50k-entry enum): bounded so one request cannot hold the compile pool for minutes.
MAX_SCHEMA_DEPTH = 64  # nesting of objects / arrays in a JSON schema, of groups in a regex
MAX_ENUM_ENTRIES = 4096  # enum / const values in a schema, alternatives (|) in a regex or grammar


def _nesting(text: str, opening: str, closing: str, quote: str | None) -> int:
    """The deepest nesting of ``opening`` / ``closing`` in ``text``, outside ``quote``-d strings
    (backslash escapes honoured): linear, no parse (a deep document would exhaust a parser first)."""
    depth = worst = 0
    in_str = escaped = False
    for ch in text:
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                in_str = False
        elif ch == "\\" and quote is None:
            escaped = not escaped
        elif escaped:
            escaped = False
        elif ch == quote:
            in_str = True
        elif ch in opening:
            depth += 1
            worst = max(worst, depth)
        elif ch in closing:
            depth -= 1
    return worst


def _enum_entries(schema: Any) -> int:
    """enum / const values anywhere in a parsed schema (iterative: no recursion limit)."""
    count, stack = 0, [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "enum" and isinstance(v, list):
                    count += len(v)
                elif k == "const":
                    count += 1
                stack.append(v)
        elif isinstance(node, list):
            stack.extend(node)
    return count


@dataclass
class StructuredOutputsParams:
    """A constraint on the generated text (vLLM's names). Exactly one kind is set: ``json`` (a JSON
    schema, dict or string), ``regex``, ``choice`` (a list of strings), ``grammar`` (EBNF / Lark),
    ``json_object`` (any JSON object) or ``structural_tag`` (xgrammar's tagged-schema format, JSON).
    The backend that enforces it is chosen once for the engine (``structured_outputs_config``)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_fallback: bool = False  # auto backend: do not fall back when the first backend cannot compile
    disable_any_whitespace: bool = False  # JSON: no free whitespace between tokens
    disable_additional_properties: bool = False  # JSON: objects take only the schema's properties
    whitespace_pattern: str | None = None  # JSON: a regex for the whitespace between tokens (outlines)
    backend: str | None = None  # refused: the engine chooses the backend

    def __post_init__(self) -> None:
        import json as _json

        def bad(field_name: str, msg: str) -> None:
            raise SamplingParamsError(f"structured_outputs.{field_name}", msg)

        if self.backend is not None:
            bad("backend", "the structured output backend is chosen at engine level "
                "(structured_outputs_config={'backend': ...} or --structured-outputs-backend), not per request")
        if self.json_object is False:
            self.json_object = None
        given = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            what = "none was given" if not given else f"got {len(given)}: {', '.join(given)}"
            bad(given[1] if len(given) > 1 else "json",
                f"exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)} must be set, {what}")
        if isinstance(self.json, dict):
            try:
                self.json = _json.dumps(self.json)
            except (TypeError, ValueError) as e:
                bad("json", f"the schema is not serialisable as JSON: {e}")
        if self.json is not None:
            if not isinstance(self.json, str):
                bad("json", f"must be a JSON schema (a dict or a JSON string), got {type(self.json).__name__}")
            if len(self.json) > MAX_GRAMMAR_SPEC_LEN:
                bad("json", f"at most {MAX_GRAMMAR_SPEC_LEN} characters, got {len(self.json)}")
            depth = _nesting(self.json, "[{", "]}", '"')
            if depth > MAX_SCHEMA_DEPTH:
                bad("json", f"the schema nests {depth} deep, over the limit of {MAX_SCHEMA_DEPTH}")
            try:
                schema = _json.loads(self.json)
            except ValueError as e:
                bad("json", f"not valid JSON: {e}")
            if not isinstance(schema, (dict, bool)):
                bad("json", "a JSON schema must be an object (or true/false)")
            entries = _enum_entries(schema)
            if entries > MAX_ENUM_ENTRIES:
                bad("json", f"the schema has {entries} enum/const values, over the limit of {MAX_ENUM_ENTRIES}")
        for name in ("regex", "grammar", "structural_tag", "whitespace_pattern"):
            v = getattr(self, name)
            if v is None:
                continue
            if not isinstance(v, str) or not v:
                bad(name, "must be a non-empty string")
            if len(v) > MAX_GRAMMAR_SPEC_LEN:
                bad(name, f"at most {MAX_GRAMMAR_SPEC_LEN} characters, got {len(v)}")
            if name in ("regex", "grammar"):
                alternatives = v.count("|")
                if alternatives > MAX_ENUM_ENTRIES:
                    bad(name, f"{alternatives} alternatives (|), over the limit of {MAX_ENUM_ENTRIES}")
            if name == "regex":
                depth = _nesting(v, "(", ")", None)
                if depth > MAX_SCHEMA_DEPTH:
                    bad(name, f"groups nest {depth} deep, over the limit of {MAX_SCHEMA_DEPTH}")
        if self.regex is not None:
            import re
            try:
                re.compile(self.regex)
            except re.error as e:
                bad("regex", f"invalid regular expression: {e}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                bad("choice", "must be a non-empty list of strings")
            if len(self.choice) > MAX_CHOICES:
                bad("choice", f"at most {MAX_CHOICES} entries, got {len(self.choice)}")
            if not all(isinstance(c, str) and c for c in self.choice):
                bad("choice", "entries must be non-empty strings")
            self.choice = list(self.choice)
        if self.structural_tag is not None:
            try:
                tag = _json.loads(self.structural_tag)
            except ValueError as e:
                bad("structural_tag", f"not valid JSON: {e}")
            if not isinstance(tag, dict):
                bad("structural_tag", "must be a JSON object")
        # Set by the engine when it accepts the request: the backend that serves it.
        self._backend: str | None = None
        self._backend_was_auto = False

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) is not None)


class RequestOutputKind(enum.Enum):
    """What a request's outputs carry as it runs (vLLM's names): everything so far (CUMULATIVE), only what is
    new (DELTA), or one output when it finishes (FINAL_ONLY: no output built per step; ``LLM.generate`` sets it,
    as vLLM's does)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0  # subtracted once from tokens already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # CTRL-style: divides positive / multiplies negative logits of seen tokens
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # top-k logprobs per output position (sampled token always included)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    bad_words: list[str] | None = None  # words (their token sequences) never generated
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # only these may be generated
    structured_outputs: StructuredOutputsParams | None = None  # constrain the output (JSON schema, regex, ...)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Removed in V1; accepted only to give a clear error.
    best_of: int | None = None
    logits_processors: Any = None
    extra_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._check_numbers()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = _bounded_list("stop", self.stop, MAX_STOP_STRINGS, str, MAX_STOP_STR_LEN)
        self.stop_token_ids = _token_ids("stop_token_ids", self.stop_token_ids, MAX_STOP_TOKEN_IDS)
        self.bad_words = _bounded_list("bad_words", self.bad_words, MAX_BAD_WORDS, str, MAX_BAD_WORD_LEN)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_ids("allowed_token_ids", self.allowed_token_ids, MAX_ALLOWED_TOKEN_IDS)
        if self.logit_bias:
            if not isinstance(self.logit_bias, dict):
                raise SamplingParamsError("logit_bias", "must be a mapping of token id -> bias")
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise SamplingParamsError("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError, OverflowError):
                raise SamplingParamsError("logit_bias", "keys must be token ids and values numbers") from None
            for k, v in self.logit_bias.items():
                if not INT64_MIN <= k <= INT64_MAX:
                    raise SamplingParamsError("logit_bias", f"token id {k} is out of the int64 range")
                if not -MAX_LOGIT_BIAS_VALUE <= v <= MAX_LOGIT_BIAS_VALUE:  # NaN fails this too
                    raise SamplingParamsError("logit_bias", f"bias values must be finite numbers in "
                                              f"[-{MAX_LOGIT_BIAS_VALUE:g}, {MAX_LOGIT_BIAS_VALUE:g}], got {v} for {k}")
        # Token sequences of bad_words, filled by the engine with its tokenizer.
        self.bad_words_token_ids: list[list[int]] = []
        if self.top_k == -1:
            self.top_k = 0
        if not isinstance(self.output_kind, RequestOutputKind):
            try:
                self.output_kind = RequestOutputKind(self.output_kind)
            except ValueError:
                raise SamplingParamsError("output_kind", f"must be a RequestOutputKind (CUMULATIVE, DELTA or "
                                          f"FINAL_ONLY), got {self.output_kind!r}") from None
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            if not isinstance(self.structured_outputs, dict):
                raise SamplingParamsError("structured_outputs", "must be a StructuredOutputsParams or a dict")
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:
                raise SamplingParamsError("structured_outputs", str(e)) from None
        self._validate()

    def _check_numbers(self) -> None:
        """Integers are int64, floats finite numbers: nothing else reaches torch."""
        for name in _INT_FIELDS:
            v = getattr(self, name)
            if v is None and name in ("seed", "max_tokens", "logprobs", "prompt_logprobs", "best_of"):
                continue
            if not isinstance(v, numbers.Integral):
                raise SamplingParamsError(name, f"must be an integer, got {v!r}")
            if not INT64_MIN <= v <= INT64_MAX:
                raise SamplingParamsError(name, f"{v} is out of the int64 range [{INT64_MIN}, {INT64_MAX}]")
            setattr(self, name, int(v))
        for name in _FLOAT_FIELDS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise SamplingParamsError(name, f"must be a number, got {v!r}")
            if not math.isfinite(v):
                raise SamplingParamsError(name, f"must be a finite number, got {v}")
            setattr(self, name, float(v))

    def _validate(self) -> None:
        def bad(param: str, msg: str) -> None:
            raise SamplingParamsError(param, msg)

        if self.best_of is not None and self.best_of != self.n:
            bad("best_of", "best_of is removed (as in vLLM V1): use n and rank the outputs on the client, "
                "or send several requests")
        if self.logits_processors:
            bad("logits_processors", "per-request logits processors are not supported: register a global one "
                "through the vllite_register_logits_processors plugin hook or the --logits-processors engine argument")
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            bad("n", f"must be an integer in [1, {MAX_N}], got {self.n!r}")
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            bad("temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", f"must be 0 or -1 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            bad("repetition_penalty", f"must be in (0, {MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            bad("allowed_token_ids", "must not be empty")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if self.min_tokens < 0:
            bad("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            bad("logprobs", f"must be >= 0, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            bad("prompt_logprobs", f"must be >= 0, got {self.prompt_logprobs}")
        if any(not s for s in self.stop):  # type: ignore[union-attr]
            bad("stop", "stop strings must be non-empty")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", f"must be an integer, got {self.seed!r}")
        if self.seed is not None and self.seed + self.n - 1 > INT64_MAX:  # n > 1: completion i uses seed + i
            bad("seed", f"seed + n - 1 must be <= {INT64_MAX}, got seed={self.seed}, n={self.n}")

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids named by the request must exist in the model's vocabulary."""
        for name, ids in (("allowed_token_ids", self.allowed_token_ids or []),
                          ("logit_bias", list((self.logit_bias or {}).keys())),
                          ("stop_token_ids", self.stop_token_ids or [])):
            bad_ids = [t for t in ids if not 0 <= t < vocab_size]
            if bad_ids:
                raise SamplingParamsError(name, f"token id {bad_ids[0]} is out of range [0, {vocab_size})")

    def tokenize_bad_words(self, tokenizer: Any, vocab_size: int) -> None:
        """Each bad word bans its token sequence, with and without a leading space. Sequences with
        ids the model cannot produce (tokenizer larger than the vocabulary) can never occur: dropped."""
        seqs: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()  # linear in the number of words (a list scan was quadratic)
        for word in self.bad_words or []:
            for variant in (word, " " + word.lstrip()):
                ids = list(tokenizer.encode(variant, add_special_tokens=False))
                key = tuple(ids)
                if ids and key not in seen and all(0 <= t < vocab_size for t in ids):
                    seen.add(key)
                    seqs.append(ids)
        self.bad_words_token_ids = seqs

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def max_stop_str_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)  # type: ignore[union-attr]


def _bounded_list(name: str, values: Any, max_len: int, item_type: type, max_item_len: int) -> list:
    values = list(values or [])
    if len(values) > max_len:
        raise SamplingParamsError(name, f"at most {max_len} entries, got {len(values)}")
    for v in values:
        if not isinstance(v, item_type):
            raise SamplingParamsError(name, f"entries must be {item_type.__name__}, got {v!r}")
        if len(v) > max_item_len:
            raise SamplingParamsError(name, f"an entry is {len(v)} long, more than {max_item_len}")
    return values


def _token_ids(name: str, values: Any, max_len: int) -> list[int]:
    values = list(values or [])
    if len(values) > max_len:
        raise SamplingParamsError(name, f"at most {max_len} entries, got {len(values)}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise SamplingParamsError(name, f"entries must be integer token ids, got {v!r}")
        if not INT64_MIN <= v <= INT64_MAX:
            raise SamplingParamsError(name, f"token id {v} is out of the int64 range")
    return [int(v) for v in values]


@dataclass
class BeamSearchParams:
    """vLLM's beam-search parameters."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise SamplingParamsError("beam_width", f"must be at least 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise SamplingParamsError("max_tokens", f"must be at least 1, got {self.max_tokens}")
