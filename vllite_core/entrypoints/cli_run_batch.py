"""`vllite run-batch`: an OpenAI batch file (JSONL) in, its results (JSONL) out, on one engine."""
from __future__ import annotations

import argparse
import os
from typing import Any

from vllite_core.entrypoints.engine_args_cli import add_engine_args, engine_args_from_namespace


def add_run_batch_parser(sub: Any) -> None:
    p = sub.add_parser("run-batch", help="run an OpenAI batch file (completions, chat, embeddings) offline")
    g = p.add_argument_group("batch")
    g.add_argument("-i", "--input-file", required=True,
                   help="JSONL, one {custom_id, method, url, body} per line (OpenAI's batch input format)")
    g.add_argument("-o", "--output-file", required=True, help="JSONL results, one per input line, in input order")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="names the lines' body.model may use (default: the model path, or SmolLM2-135M-Instruct)")
    g.add_argument("--chat-template", default=None, help="chat template: a file path or the template itself")
    g.add_argument("--max-concurrency", type=int, default=256, help="lines in flight at once (default 256)")
    g.add_argument("--disable-progress-bar", action="store_true", help="no progress bar")
    add_engine_args(p)
    p.set_defaults(func=run_batch)


def run_batch(ns: argparse.Namespace) -> int:
    from vllite_core.engine.async_llm import AsyncLLM
    from vllite_core.entrypoints.chat_template import load_chat_template
    from vllite_core.entrypoints.openai.api_server import build_app, default_model_name
    from vllite_core.entrypoints.openai.run_batch import run_batch_file

    if not os.path.isfile(ns.input_file):
        raise SystemExit(f"vllite run-batch: no input file {ns.input_file!r}")
    if ns.max_concurrency < 1:
        raise SystemExit("vllite run-batch: --max-concurrency must be at least 1")
    try:
        template = load_chat_template(ns.chat_template)
    except (OSError, ValueError) as e:
        raise SystemExit(f"vllite run-batch: {e}")
    names = ns.served_model_name or [default_model_name(ns.model)]
    engine = AsyncLLM.from_engine_args(engine_args_from_namespace(ns))
    try:
        app = build_app(engine, names, enable_docs=False, chat_template=template)
        total, failed = run_batch_file(app, ns.input_file, ns.output_file, ns.max_concurrency,
                                       progress=not ns.disable_progress_bar)
    finally:
        engine.close()
    print(f"vllite run-batch: {total} line(s), {failed} failed; results in {ns.output_file}", flush=True)
    return 0
