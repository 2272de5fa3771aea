#!/usr/bin/env bash
# Set up everything, then serve the embedded default model (SmolLM2-135M-Instruct) over the
# OpenAI API on 127.0.0.1:8000. It prints a curl line to query it; Ctrl-C stops it.
# Extra arguments go to `vllite serve` (e.g. --port 8080, --api-key KEY, --model PATH).
# Offline instead of serving: .venv/bin/vllite generate --chat-template "What is the capital of France?"
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec .venv/bin/vllite serve "$@"
