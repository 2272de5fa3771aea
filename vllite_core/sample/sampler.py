"""Batched sampling with vLLM V1's logprobs semantics.

Order: raw logits -> [raw_logprobs / raw_logits captured] -> allowed ids, bad
words, min_tokens, logit bias, global processors, penalties -> greedy argmax |
temperature, top-k, top-p, min-p -> [processed_logprobs / processed_logits
captured] -> sample. Random rows use the exponential race (argmax of p / q with
q ~ Exp(1)), so a seeded row draws from its own generator while the rest of the
batch shares one draw. A batch of greedy rows with none of those steps to apply and no logprobs
wanted takes only the argmax, of the logits as the model returned them. The argmax (here and
in the random rows' race) is the platform's ``ModelOps.argmax_rows``.

Faults of one row: a global processor that raises is re-run on each row alone to find
the rows it fails on, and a row whose constrained logits have no finite maximum (a NaN,
a +inf, or every token banned) is caught with one ``amax`` per step. Either way
``RowFaults`` names the rows before anything is sampled (no generator has drawn), so the
runner can drop them and sample the rest unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllite_core.model_ops import ModelOps, current_model_ops
from vllite_core.sample.logits_processor import BatchInfo
from vllite_core.sample.metadata import SamplingMetadata
from vllite_core.sampling_params import GREEDY_EPS
from vllite_core.structured_output.bitmask import apply_token_bitmask

_NEG_INF = float("-inf")


class RowFaults(Exception):
    """Rows of the batch that cannot be sampled, each with the reason (row index -> message)."""

    def __init__(self, rows: dict[int, str]) -> None:
        super().__init__("; ".join(f"row {r}: {m}" for r, m in sorted(rows.items())))
        self.rows = rows


def _processor_name(proc: object) -> str:
    return getattr(proc, "name", None) or type(proc).__qualname__


def _batch_row(batch: BatchInfo, i: int) -> BatchInfo:
    return BatchInfo(req_ids=batch.req_ids[i:i + 1], params=batch.params[i:i + 1],
                     prompt_token_ids=batch.prompt_token_ids[i:i + 1],
                     output_token_ids=batch.output_token_ids[i:i + 1])


def _find_failing_rows(proc: object, logits: torch.Tensor, batch: BatchInfo, exc: BaseException) -> RowFaults:
    """The batched call raised: call the processor on each row alone. Rows that raise on their own are
    the culprits; when none does, the failure belongs to no request and ``exc`` goes on up."""
    name = _processor_name(proc)
    rows: dict[int, str] = {}
    for i in range(logits.shape[0]):
        try:
            proc.apply(logits[i:i + 1].clone(), _batch_row(batch, i))  # type: ignore[attr-defined]
        except Exception as e:  # noqa: BLE001 - a processor may raise anything; it is reported per request
            rows[i] = f"logits processor {name} raised {type(e).__name__}: {e}"
    if not rows:
        raise exc
    return RowFaults(rows)


def check_finite_rows(logits: torch.Tensor) -> None:
    """One reduction per step: a row whose maximum is not finite holds a NaN or +inf, or bans every token."""
    top = logits.amax(dim=-1)
    bad = ~torch.isfinite(top)
    if bool(bad.any()):
        rows = {}
        for i in bad.nonzero().flatten().tolist():
            row = logits[i]
            if bool(row.isnan().any()):
                what = "NaN"
            elif bool((row == float("inf")).any()):
                what = "+inf"
            else:
                what = "every token banned (-inf)"
            rows[i] = f"the logits row holds no samplable value ({what}) after the logits processors"
        raise RowFaults(rows)


@dataclass
class LogprobsTensors:
    """Top-k logprob values per row; column 0 is the sampled (or target) token."""

    token_ids: torch.Tensor  # int64 [N, 1 + k]
    values: torch.Tensor  # float32 [N, 1 + k]
    ranks: torch.Tensor  # int64 [N], 1-based rank of column 0's token


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # int64 [N]
    logprobs: LogprobsTensors | None


class Sampler:
    def __init__(self, logprobs_mode: str = "raw_logprobs", ops: ModelOps | None = None) -> None:
        self.logprobs_mode = logprobs_mode
        self.argmax = (ops or current_model_ops()).argmax_rows  # the platform's, built inside use_model_ops

    def forward(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        if md.all_greedy and md.max_num_logprobs is None and not md.constrained:
            return SamplerOutput(sampled_token_ids=self.greedy_only(logits), logprobs=None)
        logits = logits.float()
        want = md.max_num_logprobs is not None
        captured = self.as_mode(logits) if want and self.logprobs_mode.startswith("raw") else None
        logits = self.apply_constraints(logits, md)
        check_finite_rows(logits)
        greedy = None if md.all_random else self.argmax(logits)
        if md.all_greedy:
            processed = logits
            sampled = greedy
        else:
            processed = self.apply_sampling_params(logits, md)
            sampled = self.random_sample(processed, md)
            if greedy is not None:
                sampled = torch.where(md.temperature < GREEDY_EPS, greedy, sampled)
        if want and captured is None:
            if not md.all_greedy and not md.all_random:
                # Greedy rows report the distribution they were chosen from (no temperature).
                processed = torch.where((md.temperature < GREEDY_EPS).unsqueeze(1), logits, processed)
            captured = self.as_mode(processed)
        lp = gather_logprobs(captured, sampled, md.max_num_logprobs or 0) if want else None
        return SamplerOutput(sampled_token_ids=sampled, logprobs=lp)

    def greedy_only(self, logits: torch.Tensor) -> torch.Tensor:
        """Every row greedy, unconstrained, no logprobs: the argmax of the logits as they are (a 16-bit row's
        argmax is its float32 copy's), and the finite check on the chosen values alone: the argmax takes a
        NaN first, then +inf, and a row of -inf gives -inf, so a chosen value is finite exactly when the row's
        maximum is."""
        ids = self.argmax(logits)
        if not bool(torch.isfinite(logits.gather(1, ids.unsqueeze(1))).all()):
            check_finite_rows(logits.float())  # raises, naming the rows
        return ids

    def as_mode(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.log_softmax(dim=-1) if self.logprobs_mode.endswith("logprobs") else logits.clone()

    @staticmethod
    def apply_constraints(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """What changes the choice of every row, greedy included: the grammar mask, bans, bias, processors,
        penalties."""
        if md.grammar_bitmask is not None:
            logits = apply_token_bitmask(logits, md.grammar_rows, md.grammar_bitmask)
        if md.allowed_mask is not None:
            logits = logits.masked_fill(~md.allowed_mask, _NEG_INF)
        if md.banned is not None:
            logits = logits.index_put(md.banned, torch.tensor(_NEG_INF))
        if md.bias is not None:
            rows, cols, vals = md.bias
            logits = logits.index_put((rows, cols), vals, accumulate=True)
        for proc in md.processors:
            before = logits
            try:
                logits = proc.apply(logits, md.batch_info)
            except Exception as e:  # noqa: BLE001 - find the rows it belongs to (or re-raise)
                raise _find_failing_rows(proc, before, md.batch_info, e) from e
        if md.repetition is not None and md.seen_mask is not None:
            r = md.repetition.unsqueeze(1)
            # A penalty near 0 divides a positive logit past the float range: cap it at the largest finite
            # value (the token is then simply the favourite), so an extreme but valid request still samples.
            penalised = torch.where(logits > 0, logits / r, logits * r).clamp(max=torch.finfo(logits.dtype).max)
            logits = torch.where(md.seen_mask, penalised, logits)
        if md.output_counts is not None:
            if md.frequency is not None:
                logits = logits - md.frequency.unsqueeze(1) * md.output_counts
            if md.presence is not None:
                logits = logits - md.presence.unsqueeze(1) * (md.output_counts > 0).float()
        return logits

    @staticmethod
    def apply_sampling_params(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p on a batch; masked entries become -inf."""
        temp = torch.where(md.temperature < GREEDY_EPS, torch.ones_like(md.temperature), md.temperature)
        logits = logits / temp.unsqueeze(1)
        if md.top_k is not None or md.top_p is not None:
            logits = apply_top_k_top_p(logits, md.top_k, md.top_p)
        if md.min_p is not None:
            probs = logits.softmax(dim=-1)
            thresh = probs.amax(dim=-1, keepdim=True) * md.min_p.unsqueeze(1)
            logits = logits.masked_fill(probs < thresh, _NEG_INF)
        return logits

    def random_sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        probs = logits.softmax(dim=-1)
        q = torch.empty_like(probs)
        if len(md.generators) < probs.shape[0]:
            q.exponential_()
        for row, gen in md.generators.items():
            q[row].exponential_(generator=gen)
        return self.argmax(probs.div_(q))


def gather_logprobs(values: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """Values of ``token_ids`` (one per row) with their rank, plus each row's top-k."""
    chosen = values.gather(1, token_ids.unsqueeze(1))
    ranks = (values > chosen).sum(dim=-1) + 1
    if k > 0:
        top_vals, top_ids = values.topk(k, dim=-1)
        return LogprobsTensors(torch.cat([token_ids.unsqueeze(1), top_ids], dim=1),
                               torch.cat([chosen, top_vals], dim=1), ranks)
    return LogprobsTensors(token_ids.unsqueeze(1), chosen, ranks)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask outside top-k and the top-p nucleus, with one sort for the whole batch."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        # Keep the last k (largest) entries of each ascending row.
        kth = (vocab - top_k.clamp(1, vocab)).unsqueeze(1)
        kth_val = sorted_logits.gather(1, kth)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_val, _NEG_INF)
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        cum = probs.cumsum(dim=-1)
        drop = cum <= (1 - top_p).unsqueeze(1)
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
