#!/usr/bin/env bash
# GPU check: on a machine with an NVIDIA GPU and a CUDA build of torch 2.13, install the CUDA platform
# (editable, from this tree, no network needed), run the platform conformance kit on it and a short
# throughput benchmark. Aims at < 5 minutes. Results go to $OUT (else results/gpu_check-DATE):
#   env.txt / env.json     torch, GPU and `vllite env` facts
#   aot.txt                the Triton kernels compiled for sm_80 / sm_90 / gfx942 (no GPU needed)
#   conformance.txt/.xml   the kit with the Triton backend (the default)
#   conformance-sdpa.txt   the kit's contract + attention checks with the SDPA fallback
#   throughput.json/.txt   offline generation and attention kernel timings
#   summary.txt            one line per step: PASS / FAIL / SKIP
# Exit status: 0 when every step passed.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
OUT_DIR=${OUT:-$REPO/results/gpu_check-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT_DIR"
SUMMARY="$OUT_DIR/summary.txt"
: > "$SUMMARY"
STATUS=0
note() { echo "$1" | tee -a "$SUMMARY"; }
step() {  # step NAME TIMEOUT_S LOGFILE CMD...
  local name=$1 limit=$2 log=$3; shift 3
  local t0=$SECONDS
  if timeout "$limit" "$@" > "$log" 2>&1; then
    note "PASS $name ($((SECONDS - t0)) s)"
  else
    note "FAIL $name (exit $?, $((SECONDS - t0)) s; see $(basename "$log"))"; STATUS=1
  fi
}

# 1. A python whose torch sees a CUDA GPU. A venv on top of it (system site packages: torch stays theirs).
PY=${PYTHON:-python3}
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() and torch.version.cuda else 1)' 2>/dev/null; then
  note "FAIL no CUDA GPU visible to $PY's torch; nothing to check"; exit 1
fi
VENV=${GPU_CHECK_VENV:-/tmp/vllite-gpu-check-venv}
[ -x "$VENV/bin/python" ] || "$PY" -m venv --system-site-packages "$VENV"
VPY="$VENV/bin/python"
PIP="$VPY -m pip --disable-pip-version-check -q"
$PIP install --no-deps --no-build-isolation -e . -e platforms/triton_common -e platforms/cuda -e platforms/cpu \
  > "$OUT_DIR/install.txt" 2>&1 || { note "FAIL install (see install.txt)"; exit 1; }
# Runtime and test dependencies, pinned, never torch (theirs is the CUDA build) nor triton (it comes with it).
missing=$("$VPY" - <<'EOF'
import importlib.util
mods = {"transformers": "transformers", "tokenizers": "tokenizers", "safetensors": "safetensors", "gguf": "gguf",
        "pluggy": "pluggy", "numpy": "numpy", "jinja2": "Jinja2", "tqdm": "tqdm", "psutil": "psutil",
        "pytest": "pytest", "triton": None}
print(" ".join(d or m for m, d in mods.items() if importlib.util.find_spec(m) is None))
EOF
)
if [ -n "$missing" ]; then
  pins=$(grep -hiE "^($(echo "$missing" | tr ' ' '|'))==" requirements.txt requirements-test.txt | grep -viE '^(torch|triton)==')
  echo "installing missing: $pins" >> "$OUT_DIR/install.txt"
  # shellcheck disable=SC2086
  $PIP install --no-deps $pins >> "$OUT_DIR/install.txt" 2>&1 || { note "FAIL missing dependencies: $missing"; exit 1; }
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false TRITON_DEFAULT_FP_FUSION=1
unset TRITON_INTERPRET VLLITE_PLATFORM VLLITE_ATTENTION_BACKEND

"$VPY" - > "$OUT_DIR/env.txt" 2>&1 <<'EOF'
import torch, triton
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"gpu {i}: {p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.1f} GiB")
EOF
"$VENV/bin/vllite" env --device cuda --json > "$OUT_DIR/env.json" 2>> "$OUT_DIR/env.txt" \
  && note "PASS vllite env --device cuda" || { note "FAIL vllite env --device cuda (see env.txt)"; STATUS=1; }

# 2. Ahead-of-time compilation of the shared kernels for the other GPU families.
step "triton kernels compile for sm_80, sm_90, gfx942" 120 "$OUT_DIR/aot.txt" \
  "$VPY" -m vllite_triton_kernels.aot cuda:80 cuda:90 hip:gfx942

# 3. The conformance kit (Triton attention, CUDA graphs, memory profiling, engine vs eager vs HF).
KIT=(-m pytest -p vllite_core.conformance.pytest_plugin -p no:cacheprovider -q -rs)
step "conformance kit on cuda (triton)" 240 "$OUT_DIR/conformance.txt" \
  "$VPY" "${KIT[@]}" --vllite-platform cuda --junitxml="$OUT_DIR/conformance.xml"
step "conformance kit on cuda (sdpa fallback: contract + attention)" 120 "$OUT_DIR/conformance-sdpa.txt" \
  env VLLITE_ATTENTION_BACKEND=sdpa "$VPY" "${KIT[@]}" --vllite-platform cuda -k "contract or attention"

# 4. Throughput (numbers only; nothing asserted).
step "throughput benchmark" 150 "$OUT_DIR/throughput.txt" \
  "$VPY" benchmarks/platform_throughput.py --device cuda --dtype bfloat16 --out "$OUT_DIR/throughput.json"

note "results in $OUT_DIR"
exit $STATUS
