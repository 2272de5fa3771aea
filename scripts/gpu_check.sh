#!/usr/bin/env bash
# GPU check: on a machine with an NVIDIA GPU and a CUDA build of torch, install the CUDA platform
# (from this tree, beside the system torch, no network needed), run the platform conformance kit on it and a short
# throughput benchmark. Aims at < 5 minutes. Results go to $OUT (else results/gpu_check-DATE):
#   env.txt / env.json     torch, GPU and `vllite env` facts
#   aot.txt                the Triton kernels compiled ahead of time for sm_80 and gfx942
#   conformance.txt/.xml   the kit with the Triton backend (the default)
#   conformance-sdpa.txt   the kit's contract + attention checks with the SDPA fallback
#   throughput.json/.txt   offline generation (eager and with CUDA graphs) and attention kernel timings
#   mp.txt                 the mp executor (one worker process) against the in-process worker
#   summary.txt            one line per step: PASS / FAIL / SKIP
# Exit status: 0 when every step passed.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
OUT_DIR=${OUT:-$REPO/results/gpu_check-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT_DIR" && OUT_DIR=$(cd "$OUT_DIR" && pwd)
SUMMARY="$OUT_DIR/summary.txt"
: > "$SUMMARY"
STATUS=0
note() { echo "$1" | tee -a "$SUMMARY"; }
SKIP=" ${GPU_CHECK_SKIP:-} "  # e.g. GPU_CHECK_SKIP="bench aot": steps to leave out (kit, bench, sdpa, aot, mp)
step() {  # step KEY NAME TIMEOUT_S LOGFILE CMD...
  local key=$1 name=$2 limit=$3 log=$4; shift 4
  local t0=$SECONDS
  if [[ "$SKIP" == *" $key "* ]]; then note "SKIP $name (GPU_CHECK_SKIP)"; return; fi
  if timeout "$limit" "$@" > "$log" 2>&1; then
    note "PASS $name ($((SECONDS - t0)) s)"
  else
    note "FAIL $name (exit $?, $((SECONDS - t0)) s; see $(basename "$log"))"; STATUS=1
  fi
}

# 1. A python whose torch sees a CUDA GPU; vllite installed beside it into a folder of its own (--target,
#    on PYTHONPATH): the python's environment and its torch stay untouched, and no network is needed.
PY=${PYTHON:-python3}
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() and torch.version.cuda else 1)' 2>/dev/null; then
  note "FAIL no CUDA GPU visible to $PY's torch; nothing to check"; exit 1
fi
SITE=${GPU_CHECK_SITE:-/tmp/vllite-gpu-check-site}
rm -rf "$SITE" && mkdir -p "$SITE"
PIP="$PY -m pip --disable-pip-version-check -q"
$PIP install --no-deps --no-build-isolation --target "$SITE" . platforms/triton_common platforms/cuda platforms/cpu \
  > "$OUT_DIR/install.txt" 2>&1 || { note "FAIL install (see install.txt)"; exit 1; }
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
VPY=$PY
# Runtime and test dependencies must be there already (pinned in requirements*.txt; never torch, whose CUDA
# build is theirs, nor triton, which comes with it). With a network, the missing ones are installed.
missing=$("$VPY" - <<'EOF2'
import importlib.util
mods = {"transformers": "transformers", "tokenizers": "tokenizers", "safetensors": "safetensors", "gguf": "gguf",
        "pluggy": "pluggy", "numpy": "numpy", "jinja2": "Jinja2", "tqdm": "tqdm", "psutil": "psutil",
        "pytest": "pytest", "triton": "triton", "zmq": "pyzmq", "msgspec": "msgspec"}
print(" ".join(d for m, d in mods.items() if importlib.util.find_spec(m) is None))
EOF2
)
if [ -n "$missing" ]; then
  pins=$(grep -hiE "^($(echo "$missing" | tr ' ' '|'))==" requirements.txt requirements-test.txt | grep -viE '^(torch|triton)==')
  echo "installing missing: $pins" >> "$OUT_DIR/install.txt"
  # shellcheck disable=SC2086
  [ -n "$pins" ] && $PIP install --no-deps --target "$SITE" $pins >> "$OUT_DIR/install.txt" 2>&1 \
    || { note "FAIL missing dependencies: $missing (see install.txt)"; exit 1; }
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
"$VPY" -m vllite_core.entrypoints.cli env --device cuda --json > "$OUT_DIR/env.json" 2>> "$OUT_DIR/env.txt" \
  && note "PASS vllite env --device cuda" || { note "FAIL vllite env --device cuda (see env.txt)"; STATUS=1; }

# 2. The conformance kit (Triton attention, CUDA graphs, memory profiling, engine vs eager vs HF).
# From a folder of its own: a project's tests/conftest.py (this one's sets TRITON_INTERPRET=1 for the
# CPU-only suite) must not be loaded into the kit's run.
KIT_CWD=$(mktemp -d)
IN_KIT_CWD=(bash -c 'cd "$0" && exec "$@"' "$KIT_CWD")
KIT=(-m pytest -p vllite_core.conformance.pytest_plugin -p no:cacheprovider -q -rs)
step kit "conformance kit on cuda (triton)" 300 "$OUT_DIR/conformance.txt" \
  "${IN_KIT_CWD[@]}" "$VPY" "${KIT[@]}" --vllite-platform cuda --junitxml="$OUT_DIR/conformance.xml"

# 3. Throughput and one request's ms per token, eager and through CUDA graphs (numbers only; nothing asserted).
step bench "throughput benchmark (eager, graphs)" 300 "$OUT_DIR/throughput.txt" \
  "$VPY" benchmarks/platform_throughput.py --device cuda --dtype bfloat16 --out "$OUT_DIR/throughput.json"

# 4. The SDPA fallback on the GPU.
step sdpa "conformance kit on cuda (sdpa fallback: contract + attention)" 120 "$OUT_DIR/conformance-sdpa.txt" \
  "${IN_KIT_CWD[@]}" env VLLITE_ATTENTION_BACKEND=sdpa "$VPY" "${KIT[@]}" --vllite-platform cuda -k "contract or attention"

# 5. The kernels also compile for the other GPU families (ahead of time, no such GPU needed).
step aot "triton kernels compile for sm_80 and gfx942" 120 "$OUT_DIR/aot.txt" \
  "$VPY" -m vllite_triton_kernels.aot cuda:80 hip:gfx942

# 6. The mp executor on the GPU: one rank in a worker process, tokens equal to the in-process worker's.
step mp "mp executor (tensor_parallel_size=1) on cuda equals uni" 240 "$OUT_DIR/mp.txt" \
  "$VPY" scripts/gpu_mp_check.py

note "results in $OUT_DIR"
exit $STATUS
