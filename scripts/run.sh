#!/usr/bin/env bash
# Set up everything, then run the main job on the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
exec .venv/bin/vllite generate --chat-template --max-tokens 96 \
  "What is the capital of France?" \
  "Write one sentence about why the sky is blue." "$@"
