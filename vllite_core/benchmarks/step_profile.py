"""Where each engine step's time goes: CPU overhead versus the model's compute.

``StepProfiler.attach(llm_engine)`` wraps (on the instances only, nothing global)
the scheduler, the model runner's input preparation, the model forward, the
logits projection, the sampler and the frontend's output processing with
``perf_counter`` timers, and keeps one record per engine step:

- ``schedule``: the scheduler picking tokens;
- ``prepare``: the runner applying the scheduler's changes to its persistent
  batch and building the step's flattened inputs and attention metadata;
- ``forward``: the model's forward pass (the compiled graph when one runs);
- ``logits``: the LM head on the sampled rows;
- ``sample``: the sampler;
- ``output``: everything else of the step (runner bookkeeping after sampling,
  the scheduler's update, detokenization and output objects).

CPU overhead is ``schedule + prepare + output``; the model is
``forward + logits``. Timers cost well under a microsecond each.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, Callable

PHASES = ("schedule", "prepare", "forward", "logits", "sample", "output")
OVERHEAD = ("schedule", "prepare", "output")


@dataclass
class StepRecord:
    total: float = 0.0
    num_reqs: int = 0
    num_tokens: int = 0
    phases: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    @property
    def is_decode(self) -> bool:
        return self.num_tokens > 0 and self.num_tokens == self.num_reqs


class StepProfiler:
    def __init__(self) -> None:
        self.records: list[StepRecord] = []
        self._current: StepRecord | None = None
        self._undo: list[Callable[[], None]] = []

    # ---- wiring ------------------------------------------------------------------------------
    def _wrap(self, obj: Any, attr: str, phase: str) -> None:
        inner = getattr(obj, attr)

        @functools.wraps(inner)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                rec = self._current
                if rec is not None:
                    rec.phases[phase] += time.perf_counter() - t0

        had_own = attr in getattr(obj, "__dict__", {})
        setattr(obj, attr, timed)
        self._undo.append(lambda: setattr(obj, attr, inner) if had_own else delattr(obj, attr))

    def attach(self, llm_engine: Any) -> "StepProfiler":
        core = llm_engine.core.engine_core  # the bench's engine core runs in this process (InprocClient)
        if core.worker is None:
            raise ValueError("distributed_executor_backend: the per-step profile times the model runner in this "
                             "process, which only the uni executor has")
        runner = core.worker.runner
        self._wrap(core.scheduler, "schedule", "schedule")
        self._wrap(runner, "_update_states", "prepare")
        self._wrap(runner, "_prepare_inputs", "prepare")
        fwd_owner, fwd_attr = (runner, "model_forward") if hasattr(runner, "model_forward") else (runner, "model")
        if fwd_attr == "model":
            # No forward wrapper object: time the module call through a forward hook pair.
            self._hook_module(runner.model)
        else:
            self._wrap(fwd_owner, fwd_attr, "forward")
        self._wrap(runner.model, "compute_logits", "logits")
        self._wrap(runner.sampler, "forward", "sample")
        step = llm_engine.step

        @functools.wraps(step)
        def timed_step(*args: Any, **kwargs: Any) -> Any:
            rec = self._current = StepRecord()
            self._last_tokens = 0
            t0 = time.perf_counter()
            try:
                return step(*args, **kwargs)
            finally:
                rec.total = time.perf_counter() - t0
                rec.num_reqs = len(runner.batch.index)
                rec.num_tokens = self._last_tokens
                self._current = None
                if rec.num_tokens:
                    self.records.append(rec)

        self._last_tokens = 0
        sched_fn = core.scheduler.schedule

        def schedule_and_count(*a: Any, **k: Any) -> Any:
            so = sched_fn(*a, **k)
            self._last_tokens = so.total_num_scheduled_tokens
            return so

        core.scheduler.schedule = schedule_and_count
        llm_engine.step = timed_step
        self._undo.append(lambda: delattr(llm_engine, "step"))
        return self

    def _hook_module(self, module: Any) -> None:
        starts: list[float] = []

        def pre(_m: Any, _a: Any) -> None:
            starts.append(time.perf_counter())

        def post(_m: Any, _a: Any, _o: Any) -> None:
            if starts and self._current is not None:
                self._current.phases["forward"] += time.perf_counter() - starts.pop()

        h1, h2 = module.register_forward_pre_hook(pre), module.register_forward_hook(post)
        self._undo += [h1.remove, h2.remove]

    def detach(self) -> None:
        while self._undo:
            self._undo.pop()()

    def reset(self) -> None:
        self.records.clear()

    # ---- results -----------------------------------------------------------------------------
    @staticmethod
    def _finish(rec: StepRecord) -> dict[str, float]:
        p = dict(rec.phases)
        accounted = p["schedule"] + p["prepare"] + p["forward"] + p["logits"] + p["sample"]
        p["output"] = max(rec.total - accounted, 0.0)
        return p

    def summary(self, records: list[StepRecord] | None = None) -> dict[str, Any]:
        recs = self.records if records is None else records
        tot = dict.fromkeys(PHASES, 0.0)
        wall = 0.0
        for r in recs:
            wall += r.total
            for k, v in self._finish(r).items():
                tot[k] += v
        overhead = sum(tot[k] for k in OVERHEAD)
        model = tot["forward"] + tot["logits"]
        out: dict[str, Any] = {
            "steps": len(recs), "tokens": sum(r.num_tokens for r in recs), "step_s_total": wall,
            "step_ms_mean": 1e3 * wall / len(recs) if recs else 0.0,
            "phases_s": tot,
            "model_fraction": model / wall if wall else 0.0,
            "sampler_fraction": tot["sample"] / wall if wall else 0.0,
            "overhead_fraction": overhead / wall if wall else 0.0,
        }
        return out

    def report(self) -> dict[str, Any]:
        """All steps, decode-only steps, and decode steps at the largest batch seen."""
        out = {"all": self.summary()}
        decode = [r for r in self.records if r.is_decode]
        if decode:
            out["decode"] = self.summary(decode)
            top = max(r.num_reqs for r in decode)
            out[f"decode_batch_{top}"] = self.summary([r for r in decode if r.num_reqs == top])
            out["decode_batch_max"] = top
        return out


def overhead_rows(report: dict[str, Any]) -> list[list[Any]]:
    """Table rows (kind, steps, ms/step, each phase in ms/step, overhead %)."""
    rows = []
    for kind, s in report.items():
        if not isinstance(s, dict) or not s.get("steps"):
            continue
        n = s["steps"]
        rows.append([kind, n, s["step_ms_mean"]] + [1e3 * s["phases_s"][p] / n for p in PHASES]
                    + [100.0 * s["overhead_fraction"]])
    return rows


OVERHEAD_HEADER = ["steps", "count", "ms/step"] + [f"{p} ms" for p in PHASES] + ["overhead %"]
