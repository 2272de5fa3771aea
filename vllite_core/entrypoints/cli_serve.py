"""`vllite serve`: the OpenAI-compatible HTTP server on one engine."""
from __future__ import annotations

import argparse
import os
from typing import Any

from vllite_core.entrypoints.engine_args_cli import add_engine_args, engine_args_from_namespace

API_KEY_ENV = "VLLITE_API_KEY"


def add_serve_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("model_tag", nargs="?", default=None, help="model (same as --model)")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    g.add_argument("--port", type=int, default=8000, help="port (0: pick a free one; the start-up line says which)")
    g.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on every /v1 route (default: ${API_KEY_ENV})")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use for the model (default: the model path, or SmolLM2-135M-Instruct)")
    g.add_argument("--max-request-body-bytes", type=int, default=None, help="larger bodies get 413 (default 4 MiB)")
    g.add_argument("--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    g.add_argument("--disable-access-log", action="store_true", help="no log line per HTTP request")
    add_engine_args(p)
    p.set_defaults(func=run_serve)


def run_serve(ns: argparse.Namespace) -> int:
    from vllite_core.engine.async_llm import AsyncLLM
    from vllite_core.engine.llm_engine import LLMEngine
    from vllite_core.entrypoints.openai.api_server import bind_socket, default_model_name, serve
    from vllite_core.entrypoints.openai.serving_common import DEFAULT_MAX_BODY_BYTES

    if ns.model_tag is not None:
        if ns.model is not None and ns.model != ns.model_tag:
            raise SystemExit("vllite serve: the model is given twice, differently")
        ns.model = ns.model_tag
    api_key = ns.api_key or os.environ.get(API_KEY_ENV) or None
    names = ns.served_model_name or [default_model_name(ns.model)]
    sock = bind_socket(ns.host, ns.port)  # a busy port fails now, not after loading the model
    engine = AsyncLLM(LLMEngine.from_engine_args(engine_args_from_namespace(ns)))
    serve(engine, names, sock, api_key, ns.max_request_body_bytes or DEFAULT_MAX_BODY_BYTES,
          ns.uvicorn_log_level, not ns.disable_access_log)
    return 0
