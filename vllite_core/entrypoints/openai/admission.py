"""Admission by estimated cost: a request is charged for the logprob entries it will make the
server hold, not only counted as one request.

A prompt's length is what the scheduler budgets (KV cache, batched tokens), but ``prompt_logprobs``
(or ``echo`` with ``logprobs``) over a long prompt makes every prompt token carry k+1 decoded
entries, and ``logprobs`` with a large ``n`` x ``max_tokens`` does the same for the output: each
entry crosses the engine-core pipe, is decoded to text in the API process and held until the
response is written. The server keeps the entries of the requests in flight under
``--max-logprob-entries-in-flight``: a request over the whole budget can never run (400 naming the
field that makes it so), one that does not fit beside the requests running gets 503 + Retry-After.
"""
from __future__ import annotations

from dataclasses import dataclass

from vllite_core.entrypoints.openai.errors import APIError, bad_request
from vllite_core.sampling_params import SamplingParams

DEFAULT_MAX_LOGPROB_ENTRIES = 4 << 20  # ~0.5 GB of decoded entries held at most (about 120 bytes each)


@dataclass(frozen=True)
class RequestCost:
    """The logprob entries one engine request will produce (prompt and output)."""
    prompt_entries: int
    output_entries: int

    @property
    def total(self) -> int:
        return self.prompt_entries + self.output_entries


def estimate_cost(num_prompt_tokens: int, params: SamplingParams, max_tokens: int) -> RequestCost:
    """Upper bound of the entries: (prompt tokens - 1) x (prompt_logprobs + 1), and
    n x max_tokens x (logprobs + 1) for the sequences sampled (``max_tokens`` resolved)."""
    prompt = 0 if params.prompt_logprobs is None else max(num_prompt_tokens - 1, 0) * (params.prompt_logprobs + 1)
    seqs = max(params.n, params.best_of or 0)
    output = 0 if params.logprobs is None else seqs * max_tokens * (params.logprobs + 1)
    return RequestCost(prompt, output)


class LogprobBudget:
    """The entries charged to the requests in flight, by engine request id; a charge ends when its
    request leaves ``live`` (finished, aborted or failed), so no release can be missed."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._charged: dict[str, int] = {}

    def in_flight(self, live: set[str] | dict) -> int:
        for rid in [r for r in self._charged if r not in live]:
            del self._charged[rid]
        return sum(self._charged.values())

    def admit(self, costs: dict[str, RequestCost], live: set[str] | dict, prompt_field: str) -> None:
        """Charge ``costs`` or raise: 400 when they exceed the whole budget, 503 when they do not fit
        beside the requests in flight. Call with no await before the requests are queued."""
        total = sum(c.total for c in costs.values())
        if total == 0:
            return
        if total > self.limit:
            prompt = sum(c.prompt_entries for c in costs.values())
            output = total - prompt
            if prompt >= output:
                field, what = prompt_field, f"{prompt_field} over {len(costs)} prompt(s)"
            else:
                field, what = "logprobs", "logprobs over n x max_tokens output tokens"
            raise bad_request(f"{field}: the request would return {total} logprob entries ({what}), more than "
                              f"this server holds for all requests together ({self.limit}, "
                              "--max-logprob-entries-in-flight): ask for fewer logprobs, tokens or sequences",
                              field, "request_too_costly")
        held = self.in_flight(live)
        if held and held + total > self.limit:
            raise APIError(503, f"the server is overloaded: requests in flight hold {held} of its {self.limit} "
                           f"logprob entries and this one needs {total}: retry later", code="server_overloaded",
                           headers={"Retry-After": "1"})
        for rid, c in costs.items():
            self._charged[rid] = c.total
