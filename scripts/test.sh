#!/usr/bin/env bash
# Set up the test environment and run the whole test suite (the README's test command).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# The linter first (ruff, configured in pyproject.toml): the tree must pass it.
.venv/bin/ruff check .
# pytest exits 5 when it collects nothing: that must fail, and it does (set -e).
# Two workers (pytest-xdist), each test module on one of them (module fixtures are computed once): while one
# waits on a server start-up or a subprocess, the other runs. One per core, at most 2 (a worker peaks at 4-5 GB).
# --durations: the slowest tests, printed with every run, say where the suite's time goes.
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n auto --maxprocesses 2 --dist loadfile --durations=30 "$@"
