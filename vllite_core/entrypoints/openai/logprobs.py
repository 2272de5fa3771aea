"""Engine logprobs -> OpenAI's two formats, and vLLM's prompt_logprobs.

Completions (legacy): parallel lists ``tokens``, ``token_logprobs``, ``top_logprobs``
(a dict per position: the top k and the sampled token, so up to k+1 entries, as
OpenAI documents) and ``text_offset``. Chat: ``content`` is a list of
``{token, logprob, bytes, top_logprobs: [k entries by rank]}``.
JSON has no -inf: such values are clamped to -9999.0, as vLLM does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from vllite_core.outputs import Logprob

_FLOOR = -9999.0


def _num(v: float) -> float:
    return _FLOOR if math.isnan(v) or v < _FLOOR else float(v)


def _token_text(tid: int, lp: Logprob, tokenizer: Any) -> str:
    return lp.decoded_token if lp.decoded_token is not None else tokenizer.decode([tid])


@dataclass
class CompletionLogprobs:
    """Accumulates the legacy format across streamed pieces; ``text_offset`` keeps counting."""

    offset: int = 0
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, token_ids: list[int], entries: list[dict[int, Logprob]] | None, tokenizer: Any,
            top_k: int) -> dict[str, Any]:
        """Append positions; returns just these positions in the legacy shape."""
        piece: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for i, tid in enumerate(token_ids):
            entry = (entries[i] if entries is not None and i < len(entries) else None) or {}
            lp = entry.get(tid)
            text = _token_text(tid, lp, tokenizer) if lp is not None else tokenizer.decode([tid])
            top: dict[str, float] = {}
            for t, v in entry.items():
                if t == tid or (v.rank is not None and v.rank <= top_k):
                    top.setdefault(_token_text(t, v, tokenizer), _num(v.logprob))
            piece["tokens"].append(text)
            piece["token_logprobs"].append(_num(lp.logprob) if lp is not None else None)
            piece["top_logprobs"].append(top)
            piece["text_offset"].append(self.offset)
            self.offset += len(text)
        for k, v in piece.items():
            getattr(self, k).extend(v)
        return piece

    def as_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}


def _chat_entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": _num(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]] | None, tokenizer: Any,
                  top_k: int) -> list[dict[str, Any]]:
    """``choices[].logprobs.content`` for these tokens."""
    content = []
    for i, tid in enumerate(token_ids):
        entry = (entries[i] if entries is not None and i < len(entries) else None) or {}
        lp = entry.get(tid)
        item = _chat_entry(_token_text(tid, lp, tokenizer) if lp is not None else tokenizer.decode([tid]),
                           lp.logprob if lp is not None else _FLOOR)
        ranked = sorted(((v.rank, t, v) for t, v in entry.items() if v.rank is not None and v.rank <= top_k),
                        key=lambda x: x[0])
        item["top_logprobs"] = [_chat_entry(_token_text(t, v, tokenizer), v.logprob) for _, t, v in ranked]
        content.append(item)
    return content


def prompt_logprobs_json(plp: list[dict[int, Logprob] | None] | None, tokenizer: Any) -> list[Any] | None:
    """vLLM's shape: per prompt position None or ``{token_id: {logprob, rank, decoded_token}}``."""
    if plp is None:
        return None
    return [None if pos is None else
            {str(t): {"logprob": _num(v.logprob), "rank": v.rank, "decoded_token": _token_text(t, v, tokenizer)}
             for t, v in pos.items()}
            for pos in plp]
