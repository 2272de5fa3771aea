"""Shared reporting: percentiles, machine facts, JSON files, tables, plots."""
from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from typing import Any, Iterable, Sequence

PERCENTILES = (50, 90, 99)


def percentiles(values: Sequence[float], ps: Iterable[int] = PERCENTILES) -> dict[str, float]:
    """mean, p50/p90/p99 (linear interpolation, like numpy's default), min and max."""
    vals = sorted(float(v) for v in values)
    out: dict[str, float] = {}
    if not vals:
        return out
    out["mean"] = sum(vals) / len(vals)
    for p in ps:
        k = (len(vals) - 1) * p / 100.0
        lo, hi = math.floor(k), math.ceil(k)
        out[f"p{p}"] = vals[lo] + (vals[hi] - vals[lo]) * (k - lo)
    out["min"], out["max"] = vals[0], vals[-1]
    return out


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_facts() -> dict[str, Any]:
    """What a reader needs to judge a number: CPU, threads, OpenMP policy, load."""
    facts: dict[str, Any] = {
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "nproc": os.cpu_count(),
        "load_average": load_average(),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
    }
    if "torch" in sys.modules:
        import torch

        facts["torch"] = torch.__version__
        facts["torch_threads"] = torch.get_num_threads()
    try:
        from vllite_platform_cpu.platform import cpu_model_name, has_fast_bf16

        facts["cpu"] = cpu_model_name()
        facts["fast_bf16"] = has_fast_bf16()
    except ImportError:
        pass
    return facts


def save_json(path: str, result: Any) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2, default=str)
        f.write("\n")


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v != v:  # nan
            return "-"
        a = abs(v)
        return f"{v:.0f}" if a >= 1000 else f"{v:.1f}" if a >= 100 else f"{v:.2f}" if a >= 1 else f"{v:.4f}"
    return "-" if v is None else str(v)


def format_table(rows: Sequence[Sequence[Any]], header: Sequence[str] | None = None, title: str | None = None) -> str:
    """A plain monospace table (first column left-aligned, the rest right-aligned)."""
    cells = [[_fmt(c) for c in r] for r in rows]
    if header is not None:
        cells.insert(0, [str(h) for h in header])
    if not cells:
        return title or ""
    widths = [max(len(r[i]) for r in cells if i < len(r)) for i in range(max(len(r) for r in cells))]
    lines = []
    if title:
        lines.append(f"== {title} ==")
    for n, r in enumerate(cells):
        parts = [c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)]
        lines.append("  ".join(parts).rstrip())
        if n == 0 and header is not None:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot_xy(path: str, x: Sequence[float], series: dict[str, Sequence[float]], xlabel: str, ylabel: str,
            title: str = "", logx: bool = False) -> str | None:
    """Line plot of one or more series against x, saved as PNG. Returns the path, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install -r requirements.txt)", file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    for name, ys in series.items():
        ax.plot(list(x), list(ys), marker="o", label=name)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xticks(list(x))
    ax.set_xticklabels([str(v) for v in x])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if len(series) > 1:
        ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
