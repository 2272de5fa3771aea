"""The ``vllite`` command: a small dispatcher over subcommands.

Each subcommand lives in its own module and contributes ``add_*_parser(subparsers)``
(which sets ``func``); this file only wires them together.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from vllite_core.entrypoints.cli_bench import add_bench_parser
from vllite_core.entrypoints.cli_generate import add_chat_parser, add_generate_parser
from vllite_core.entrypoints.cli_plugins import add_env_parser, add_plugins_parser
from vllite_core.entrypoints.cli_run_batch import add_run_batch_parser
from vllite_core.entrypoints.cli_serve import add_serve_parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllite", description="vllite: plugin-based LLM inference engine")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_plugins_parser(subparsers)
    add_env_parser(subparsers)
    add_generate_parser(subparsers)
    add_chat_parser(subparsers)
    add_bench_parser(subparsers)
    add_serve_parser(subparsers)
    add_run_batch_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=os.environ.get("VLLITE_LOG_LEVEL", "INFO"), format="%(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
