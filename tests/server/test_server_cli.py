"""`vllite serve` start-up, without loading a model: a busy port fails at once with a clear
message, and the printed query line is a working curl command."""
from __future__ import annotations

import socket
import subprocess
import sys

from vllite_core.entrypoints.openai.api_server import how_to_query


def test_busy_port_fails_before_loading_the_model():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "vllite_core.entrypoints.cli", "serve", "--port", str(port)],
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr and "--port" in proc.stderr
    assert "engine ready" not in proc.stderr


def test_query_line_names_url_model_and_auth():
    line = how_to_query("127.0.0.1", 8000, "SmolLM2-135M-Instruct", api_key=None)
    assert "curl http://127.0.0.1:8000/v1/chat/completions" in line and '"model": "SmolLM2-135M-Instruct"' in line
    assert "Authorization" not in line
    assert "Authorization: Bearer" in how_to_query("::1", 9, "m", api_key="k")
