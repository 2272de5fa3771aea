"""Speculative decoding settings (vLLM's ``speculative_config``), checked when the engine is built.

Which methods exist is known only once the plugins are loaded (a plugin may add one), so the method
name is checked against the proposer registry at engine start (``vllite_core.spec_decode.registry``);
everything that needs no plugin is checked here.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from vllite_core.errors import ConfigError

# More drafts than this per step cost more verification work than a copy-heavy prompt ever repays.
MAX_NUM_SPECULATIVE_TOKENS = 16


def _error(msg: str) -> Exception:

    return ConfigError(msg)


@dataclass
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 0
    prompt_lookup_min: int | None = None  # ngram: shortest suffix that may match
    prompt_lookup_max: int | None = None  # ngram: longest suffix, tried first
    model: str | None = None  # draft_model / eagle: the draft model's (or EAGLE head's) folder

    @classmethod
    def from_value(cls, value: Any) -> "SpeculativeConfig | None":
        """A dict, a JSON object string, a SpeculativeConfig or None (speculation off)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise _error(f"speculative_config: not JSON: {e}") from None
        if not isinstance(value, dict):
            raise _error(f"speculative_config: must be a dict (or a JSON object), got {type(value).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = [k for k in value if k not in known]
        if unknown:
            raise _error(f"speculative_config: unknown key {unknown[0]!r} (known: {', '.join(known)})")
        if "method" not in value and value.get("model"):
            value = {**value, "method": infer_method(str(value["model"]))}
        cfg = cls(**value)
        cfg._check()
        return cfg

    def _check(self) -> None:
        if not isinstance(self.method, str) or not self.method:
            raise _error("speculative_config.method: must be a method name such as 'ngram'")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_NUM_SPECULATIVE_TOKENS:
            raise _error(f"speculative_config.num_speculative_tokens: must be an integer in "
                         f"[1, {MAX_NUM_SPECULATIVE_TOKENS}], got {k!r}")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                    raise _error(f"speculative_config.{name}: must be an integer >= 1, got {v!r}")
            # A missing bound takes the other's value (as vLLM does); both missing: [2, 5].
            if lo is None and hi is None:
                lo, hi = 2, 5
            elif lo is None:
                lo = hi
            elif hi is None:
                hi = lo
            if lo > hi:  # type: ignore[operator]
                raise _error(f"speculative_config: prompt_lookup_min ({lo}) is larger than prompt_lookup_max ({hi})")
            self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
        elif self.method in MODEL_METHODS and not self.model:
            raise _error(f"speculative_config.model: method {self.method!r} needs the draft model's path")


# Methods whose proposer is a model loaded from speculative_config.model.
MODEL_METHODS = ("draft_model", "eagle")


def infer_method(model: str) -> str:
    """The method of a config that names only ``model`` (as vLLM does): an EAGLE head by its name, else a
    draft model."""
    name = model.lower()
    if "eagle3" in name:
        return "eagle3"  # not built: reported as an unknown method
    return "eagle" if "eagle" in name else "draft_model"
