"""A canary for attack tests and the soak: /health every 0.2 s and a tiny completion every 0.2 s
against a running server, from a thread; it records each probe's latency and any failure, so a
test can show that the server stayed responsive while one request tried to wedge it."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class CanaryReport:
    health_s: list[float] = field(default_factory=list)
    completion_s: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def worst_s(self) -> float:
        return max(self.health_s + self.completion_s, default=0.0)

    def p99_s(self) -> float:
        xs = sorted(self.health_s + self.completion_s)
        return xs[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else 0.0


class Canary:
    def __init__(self, url: str, prompt: list[int] | None = None, period_s: float = 0.2,
                 headers: dict[str, str] | None = None) -> None:
        self.url, self.period_s = url, period_s
        self.body = {"prompt": prompt or [3, 4, 5], "max_tokens": 1, "temperature": 0}
        self.headers = headers or {}
        self.report = CanaryReport()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(kind,), daemon=True)
                         for kind in ("health", "completion")]

    def _probe(self, client: httpx.Client, kind: str) -> None:
        t0 = time.monotonic()
        try:
            if kind == "health":
                r = client.get(self.url + "/health")
            else:
                r = client.post(self.url + "/v1/completions", json=self.body, headers=self.headers)
            ok = r.status_code == 200
            why = f"{kind}: HTTP {r.status_code} {r.text[:200]}"
        except httpx.HTTPError as e:
            ok, why = False, f"{kind}: {type(e).__name__}: {e}"
        dt = time.monotonic() - t0
        (self.report.health_s if kind == "health" else self.report.completion_s).append(dt)
        if not ok:
            self.report.failures.append(why)

    def _loop(self, kind: str) -> None:
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                t0 = time.monotonic()
                self._probe(client, kind)
                self._stop.wait(max(0.0, self.period_s - (time.monotonic() - t0)))

    def __enter__(self) -> "Canary":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)


def measure(url: str, seconds: float, **kw: object) -> CanaryReport:
    """The canary alone for ``seconds``: the baseline an attack's canary is compared with."""
    with Canary(url, **kw) as c:  # type: ignore[arg-type]
        time.sleep(seconds)
    return c.report


def responsive(during: CanaryReport, baseline: CanaryReport, bound_s: float = 1.0) -> bool:
    """The issue's bound (worst probe under ``bound_s``), measured on this machine: a shared 2-core
    box can be slow with no attack at all, so the bound grows with the baseline's own worst probe."""
    return not during.failures and during.worst_s < bound_s + 3 * baseline.worst_s
