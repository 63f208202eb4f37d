#!/usr/bin/env bash
# The compatibility check: the interpreter kernel tests and the compile check (sm_75/80/90) on the
# oldest supported and the newest Triton, with NumPy 1 and NumPy 2 — the stacks learners run.
#
#   scripts/compat_check.sh [WORK_DIR]          # or: make compat; about 25-40 minutes on 2 CPU cores
#
# One virtual environment per (triton, numpy) pair is built in WORK_DIR (default /tmp/kvlib-compat) and
# kept for the next run. Every pair gets the same PyTorch (TORCH_SPEC, default the CPU-only torch==2.13.0
# wheel) and imports kvlib from this checkout (PYTHONPATH), so only Triton and NumPy change. Writes
# WORK_DIR/compat.md (the table below, one row per pair) and a log per step; exit 1 if a test failed or a
# kernel did not build (register spills on a Triton other than the pinned one are listed, not failed).
#
#   COMPAT_MATRIX   the pairs, "TRITON:NUMPY ..." (default below)
#   TORCH_SPEC      e.g. "torch==2.13.0"; any other version pulls a CUDA build of several GB
#   PYTHON          the interpreter that builds the environments (default python3)
#   COMPAT_TESTS    the test files (default: the interpreter kernel tests scripts/gpu_check.sh runs)
set -uo pipefail

WORK=${1:-${TMPDIR:-/tmp}/kvlib-compat}
MATRIX=${COMPAT_MATRIX:-"3.2.0:1.26.4 3.2.0:2.4.6 3.6.0:1.26.4 3.6.0:2.4.6 3.9.0:1.26.4 3.9.0:2.4.6"}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
PYTHON=${PYTHON:-python3}
TESTS=${COMPAT_TESTS:-"tests/test_vector_add.py tests/test_attention.py tests/test_cache.py tests/test_paged.py
  tests/test_paged_machine.py tests/test_quant.py tests/test_gqa.py tests/test_generate.py tests/test_bench.py"}
DEPS="pytest hypothesis safetensors tqdm pandas matplotlib pyyaml"

mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 MPLBACKEND=Agg KVLIB_DEVICE=cpu
unset TRITON_INTERPRET  # kvlib switches the interpreter on for the tests; the compile check sets 0

table="$WORK/compat.md"
{
  echo "| triton | numpy | torch | interpreter kernel tests | tests s | compile check sm_75/80/90 | compile s |"
  echo "|---|---|---|---|---|---|---|"
} > "$table"
failed=0

for pair in $MATRIX; do
  tri=${pair%%:*} np=${pair##*:}
  venv="$WORK/triton-$tri-numpy-$np"
  log="$WORK/triton-$tri-numpy-$np"
  echo "== triton $tri, numpy $np ($venv)"
  if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import triton, numpy, torch, pytest" 2>/dev/null; then
    "$PYTHON" -m venv "$venv" && "$venv/bin/python" -m pip install -q "$TORCH_SPEC" "triton==$tri" "numpy==$np" \
      $DEPS > "$log.install.log" 2>&1
    if [ $? -ne 0 ]; then
      echo "| $tri | $np | - | install failed (see $log.install.log) | | | |" >> "$table"
      failed=1
      continue
    fi
  fi
  torch_v=$("$venv/bin/python" -c "import torch; print(torch.__version__)")
  np_v=$("$venv/bin/python" -c "import numpy; print(numpy.__version__)")

  t0=$(date +%s)
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pytest $TESTS -q -p no:cacheprovider -o addopts="" -m "not bench_cli" > "$log.tests.log" 2>&1
  tests_rc=$?
  tests_s=$(( $(date +%s) - t0 ))
  tests=$(grep -E "^(=+ )?[0-9]+ (passed|failed|error)" "$log.tests.log" | tail -n 1 | sed -E 's/=//g; s/ in [0-9.]+s.*//; s/^ +| +$//g')
  [ -n "$tests" ] || tests="no summary (see $log.tests.log)"

  t0=$(date +%s)
  if [[ $tri == 3.2.* ]]; then  # the compile check builds with the JIT's binder, which Triton 3.2 lacks
    echo "   compile check: not run (kvlib.course.compile_check builds through the JIT internals of Triton 3.6 and later)"
    echo "| $tri | $np_v | $torch_v | $tests | $tests_s | needs Triton >= 3.6 | - |" >> "$table"
    [ "$tests_rc" -eq 0 ] || failed=1
    continue
  fi
  TRITON_INTERPRET=0 "$venv/bin/python" -m kvlib.course.compile_check --json > "$log.compile.json" 2> "$log.compile.log"
  compile_s=$(( $(date +%s) - t0 ))
  # Passes when every kernel builds and fits in shared memory; spills (which tests/test_compile.py forbids
  # on the pinned Triton) are listed, since another Triton version allocates registers differently.
  compile=$("$venv/bin/python" - "$log.compile.json" <<'EOF'
import json, sys
try:
    rows = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
except Exception:
    print("did not run (see the .compile.log)")
    sys.exit(1)
bad = [r for r in rows if not r["ok"]]
built = sum("registers" in r for r in rows)
spills = sum(1 for r in bad if "spills" in r.get("error", ""))
text = f"{len(rows) - len(bad)}/{len(rows)} ok, {built} built"
if bad:
    text += f"; {spills} spill, {len(bad) - spills} other: " + ", ".join(
        sorted({f"{r['kernel']} {r['arch']}" for r in bad}))
print(text)
sys.exit(1 if len(bad) > spills else 0)
EOF
)
  compile_rc=$?
  echo "   tests: $tests (${tests_s} s, exit $tests_rc); compile check: $compile (${compile_s} s, exit $compile_rc)"
  echo "| $tri | $np_v | $torch_v | $tests | $tests_s | $compile | $compile_s |" >> "$table"
  [ "$tests_rc" -eq 0 ] && [ "$compile_rc" -eq 0 ] || failed=1
done

echo
cat "$table"
exit $failed
