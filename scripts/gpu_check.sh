#!/usr/bin/env bash
# The GPU check: on a machine with an NVIDIA GPU, prove the kernels compiled for it and measure them.
#
#   scripts/gpu_check.sh OUT_DIR            # about 6-8 minutes
#   scripts/gpu_check.sh OUT_DIR --quick    # about 2 minutes: fewer benchmark points
#
# Needs a Python with torch (CUDA build), triton, numpy and pytest; the benchmark also uses matplotlib,
# pandas, tqdm and safetensors. No network, no pip install, no jupyter/nbval/hypothesis/pyyaml/transformers:
# kvlib is imported from this checkout (PYTHONPATH), and tests that need a missing extra skip. It uses
# $PYTHON when set, else .venv/bin/python when present, else python3. Writes to OUT_DIR:
#   environment.txt   nvidia-smi, the Python packages found, kvlib.describe() (GPU, driver, CUDA, torch, triton)
#   tests.log         the kernel tests, run with Triton compiling for this GPU (not the interpreter)
#   bench.log         python -m kvlib.bench output
#   bench/            results.csv (stamped rows), summary.md (headline table), stamp.json, one PNG per sweep
#   status.txt        one line per step with its exit status and seconds
# Exit status: 0 when the tests pass and every kernel agrees with its baseline, else 1 (2: no GPU,
# 3: torch, triton, numpy or pytest missing from that Python).
# Commit the results with:  cp -r OUT_DIR/bench docs/results/<gpu-name>/  (see docs/results/README.md)
set -uo pipefail

OUT_ARG=${1:?usage: scripts/gpu_check.sh OUT_DIR [--quick]}
QUICK=${2:-}
mkdir -p "$OUT_ARG"
OUT=$(cd "$OUT_ARG" && pwd)
cd "$(dirname "$0")/.."

if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 MPLBACKEND=Agg
unset TRITON_INTERPRET KVLIB_DEVICE   # compile for the GPU, never the interpreter

: > "$OUT/status.txt"
step() {  # step NAME LOG CMD...: run, log, record exit status and seconds
  local name=$1 log=$2; shift 2
  local t0; t0=$(date +%s)
  echo "== $name: $*" | tee -a "$OUT/status.txt"
  "$@" > "$log" 2>&1
  local rc=$?
  echo "   $name exit $rc after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/status.txt"
  tail -n 25 "$log"
  return $rc
}

# What this Python has: the four it needs, then optional ones (a missing optional one skips tests or figures).
packages() {
  "$PY" - <<'EOF'
import importlib, sys
need = ["torch", "triton", "numpy", "pytest"]
optional = ["matplotlib", "pandas", "tqdm", "safetensors", "hypothesis", "yaml", "transformers"]
missing = []
for name in need + optional:
    try:
        version = getattr(importlib.import_module(name), "__version__", "?")
    except Exception as e:  # a broken install counts as missing
        version = f"MISSING ({type(e).__name__})"
        missing += [name] if name in need else []
    print(f"  {name:<13} {version}{'' if name in need else '  (optional)'}")
print(f"python {sys.version.split()[0]} at {sys.executable}")
sys.exit(3 if missing else 0)
EOF
}
{ date -u; nvidia-smi 2>&1; packages 2>&1; "$PY" -c "import kvlib; kvlib.describe()" 2>&1; } > "$OUT/environment.txt"
cat "$OUT/environment.txt"
if ! packages > /dev/null 2>&1; then
  echo "$PY lacks torch, triton, numpy or pytest (see environment.txt): nothing to run" | tee -a "$OUT/status.txt"
  exit 3
fi
if ! "$PY" -c "import sys, kvlib; sys.exit(kvlib.runtime.mode() != 'gpu')" 2>/dev/null; then
  if [ "${GPU_CHECK_ALLOW_CPU:-0}" != 1 ]; then
    echo "no CUDA GPU visible to PyTorch with Triton installed: this script needs one" | tee -a "$OUT/status.txt"
    exit 2
  fi
  echo "DRY RUN without a GPU (GPU_CHECK_ALLOW_CPU=1): interpreter mode, for testing this script only" \
    | tee -a "$OUT/status.txt"
fi

# 1. Kernel tests, compiled for this GPU. The compile check (static, sm_80/sm_90) and the quick CLI run
#    belong to the CPU suite; the full sweep below replaces the latter.
KERNEL_TESTS="tests/test_vector_add.py tests/test_attention.py tests/test_cache.py tests/test_paged.py
  tests/test_quant.py tests/test_gqa.py tests/test_generate.py tests/test_evict.py tests/test_lowbit.py
  tests/test_bench.py tests/test_bench_sweeps.py"
# shellcheck disable=SC2086
step tests "$OUT/tests.log" timeout "${TEST_TIMEOUT_S:-270}" "$PY" -m pytest $KERNEL_TESTS -m "not bench_cli" \
  -q -p no:cacheprovider -o addopts="" -rfE
tests_rc=$?

# 2. The benchmark sweep (stops starting new points after the budget; the rows say what was skipped).
step bench "$OUT/bench.log" "$PY" -m kvlib.bench ${QUICK:+--quick} --out "$OUT/bench" \
  --budget-s "${BENCH_BUDGET_S:-210}"
bench_rc=$?

echo "tests exit $tests_rc, bench exit $bench_rc" | tee -a "$OUT/status.txt"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
