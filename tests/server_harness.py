"""Start `vllite serve` in a subprocess on 127.0.0.1 (port 0: it picks a free one and says
which on its start-up line), wait until it answers, stop it."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from typing import Any

import httpx

_URL = re.compile(r"(https?)://127\.0\.0\.1:(\d+)")


class ServerProcess:
    def __init__(self, args: list[str], env: dict[str, str] | None = None, verify: Any = True) -> None:
        """``verify``: httpx's, for an HTTPS server (an ssl.SSLContext that trusts its certificate)."""
        full_env = dict(os.environ, VLLITE_LOG_LEVEL="WARNING", OMP_WAIT_POLICY="PASSIVE", HF_HUB_OFFLINE="1")
        full_env.update(env or {})
        cmd = [sys.executable, "-m", "vllite_core.entrypoints.cli", "serve", "--host", "127.0.0.1", "--port", "0",
               "--uvicorn-log-level", "warning", "--disable-access-log", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env)
        self.lines: list[str] = []
        self.port: int | None = None
        self.scheme = "http"
        self.verify = verify
        self._found = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            m = _URL.search(line)
            if m and self.port is None:
                self.scheme, self.port = m.group(1), int(m.group(2))
                self._found.set()
        self._found.set()

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, timeout: float = 300.0) -> str:
        deadline = time.monotonic() + timeout
        self._found.wait(timeout)
        if self.port is None:
            raise RuntimeError(f"server did not start:\n{self.output}")
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output}")
            try:
                if httpx.get(self.url + "/health", timeout=5, verify=self.verify).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not healthy after {timeout}s:\n{self.output}")

    def stop(self) -> int | None:
        """Terminate (kill after 30 s) and return the exit status."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode
