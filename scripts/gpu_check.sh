#!/usr/bin/env bash
# The GPU check: on a machine with an NVIDIA GPU, prove the kernels compiled for it and measure them.
#
#   scripts/gpu_check.sh OUT_DIR            # within 9 minutes (GPU_CHECK_BUDGET_S=540): smoke pass, tests, sweeps
#   scripts/gpu_check.sh OUT_DIR --quick    # the same with fewer benchmark points (the sweeps end sooner)
#   scripts/gpu_check.sh OUT_DIR --smoke    # 1-2 minutes (at most 3): the smoke pass and one test file only
#
# Steps, each in its own process so that a crash ends one step, not the run (an illegal address poisons
# the CUDA context of its process; a segfault, an abort or a hang ends that process only):
#   1. smoke pass: every sweep at its smallest point (python -m kvlib.bench --smoke --only NAME), one
#      process per sweep, each with a GPU_CHECK_SMOKE_TIMEOUT_S limit (default 60 s; the whole pass stops
#      starting sweeps after GPU_CHECK_SMOKE_BUDGET_S, default 120 s). About a minute on a GPU (an estimate
#      until the first GPU run; on this project's 2-core CPU, in the interpreter, about 60 s).
#   2. the kernel tests, with Triton compiling for this GPU (not the interpreter), limited to TEST_TIMEOUT_S
#      (default 180 s; --smoke: tests/test_vector_add.py only, 60 s). GPU_CHECK_SKIP_TESTS=1 skips them.
#   3. (not with --smoke) the full (or --quick) sweeps, one process per sweep. They share what is left of
#      the budget (at most BENCH_BUDGET_S when set), each in proportion to its number of points + 2 (time
#      one leaves unused goes to the next): a sweep stops starting new points 5 s before its share is spent
#      (--budget-s; its rows say "skipped: time budget spent") and is killed at max(2 x share, share + 30 s,
#      90 s), never past the budget. A sweep that would start with under 20 s left is skipped, and so is
#      one whose smoke run timed out (it would hang again). Each sweep rewrites its results.csv after every
#      point.
#   4. merge: python -m kvlib.bench --merge joins the sweeps' results.csv files into bench/ (results.csv,
#      stamp.json, summary.md, one PNG per sweep), whatever became of the other sweeps; 30 s of the budget
#      are kept for it (it may run up to 45 s).
# GPU_CHECK_BUDGET_S (default 540; --smoke: 180) is the whole script's wall time, from its start (the merge
# and a killed sweep's 5 s of grace may end up to 20 s past it); a lent machine's command runs at most 600 s.
# GPU_CHECK_SWEEPS="copy decode ..." runs only those sweeps (default: all, in kvlib.bench.sweeps.SWEEPS order).
# Test hook: KVLIB_BENCH_FAULT=NAME makes sweep NAME's process abort after its first point, as a CUDA fault
# would (NAME:hang: hang until killed, as a stuck kernel would); tests/test_gpu_check.py uses it.
#
# Needs a Python with torch (CUDA build), triton, numpy and pytest; the benchmark also uses matplotlib,
# pandas, tqdm and safetensors. No network, no pip install, no jupyter/nbval/hypothesis/pyyaml/transformers:
# kvlib is imported from this checkout (PYTHONPATH), and tests that need a missing extra skip. It uses
# $PYTHON when set, else .venv/bin/python when present, else python3. Writes to OUT_DIR:
#   environment.txt   nvidia-smi, the Python packages found, kvlib.describe() (GPU, driver, CUDA, torch, triton)
#   status.txt        one line per step: its command and limit, then its exit status and seconds (or why it
#                     was skipped); the last line sums up the failures and the skipped steps
#   smoke/NAME/, smoke/NAME.log    each sweep's smoke run: results.csv, stamp.json, summary.md, its output
#   tests.log         the kernel tests
#   sweeps/NAME/, sweeps/NAME.log  each sweep's full (or --quick) run, the same files (not with --smoke)
#   merge.log         the merge's output
#   bench/            the merged results.csv (stamped rows), summary.md (headline table), stamp.json (with
#                     "parts": each sweep's rows, seconds and whether it completed), one PNG per sweep: the
#                     full sweeps' rows, or with --smoke the smoke pass's
# Exit status: 0 when every step that ran exited 0 (tests passed, every kernel agrees with its baseline, no
# sweep crashed or timed out) and something was merged, else 1 (also for a usage error); 2: no GPU;
# 3: torch, triton, numpy or pytest missing from that Python. Steps skipped for the budget are listed, not
# failures. Without a GPU, GPU_CHECK_ALLOW_CPU=1 makes a dry run in the interpreter (for testing this script;
# a CPU is slower: raise GPU_CHECK_BUDGET_S).
# Commit the results with:  cp -r OUT_DIR/bench docs/results/<gpu-name>/  (see docs/results/README.md)
set -uo pipefail

USAGE="usage: scripts/gpu_check.sh OUT_DIR [--quick | --smoke]"
if [ $# -lt 1 ] || [ $# -gt 2 ] || [ -z "$1" ]; then
  echo "$USAGE" >&2
  exit 1
fi
OUT_ARG=$1
MODE=full
case "${2:-}" in
  "") ;;
  --quick) MODE=quick ;;
  --smoke) MODE=smoke ;;
  *) echo "$USAGE (got: $2)" >&2; exit 1 ;;
esac

# Budgets in whole seconds, all overridable (see above).
int_env() {  # int_env NAME DEFAULT: the variable's value (or DEFAULT), a whole number of seconds, or exit 1
  local value=${!1:-$2}
  case $value in
    ''|*[!0-9]*) echo "$1=$value: give a whole number of seconds" >&2; exit 1 ;;
  esac
  echo "$value"
}
if [ "$MODE" = smoke ]; then default_budget=180 default_tests=60; else default_budget=540 default_tests=180; fi
BUDGET_S=$(int_env GPU_CHECK_BUDGET_S "$default_budget") || exit 1
SMOKE_BUDGET_S=$(int_env GPU_CHECK_SMOKE_BUDGET_S 120) || exit 1
SMOKE_TIMEOUT_S=$(int_env GPU_CHECK_SMOKE_TIMEOUT_S 60) || exit 1
TEST_TIMEOUT_S=$(int_env TEST_TIMEOUT_S "$default_tests") || exit 1
BENCH_BUDGET_S=$(int_env BENCH_BUDGET_S "$BUDGET_S") || exit 1
MERGE_RESERVE_S=30   # kept at the end of the budget for the merge
MERGE_TIMEOUT_S=45   # the merge's limit (it runs even when the budget is spent: it writes what there is)
MIN_START_S=20       # a sweep or a test run is not started with less time than this left
SWEEP_MIN_S=90       # the least limit of a full sweep (its share may be smaller: the limit catches hangs)

mkdir -p "$OUT_ARG" || exit 1
OUT=$(cd "$OUT_ARG" && pwd)
cd "$(dirname "$0")/.." || exit 1
rm -rf "$OUT/smoke" "$OUT/sweeps" "$OUT/bench"   # a previous run's rows must not be merged into this one's
rm -f "$OUT/tests.log" "$OUT/merge.log"

if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 MPLBACKEND=Agg
unset TRITON_INTERPRET KVLIB_DEVICE   # compile for the GPU, never the interpreter
ulimit -c 0                           # a crashing sweep must not leave a core file in the checkout

: > "$OUT/status.txt"
log_status() { echo "$*" | tee -a "$OUT/status.txt"; }
why() {  # why RC: what an exit status means, for status.txt
  case $1 in
    0|1) ;;
    124) echo " (timed out: stopped at its limit)" ;;
    137) echo " (killed by SIGKILL: still running 5 s after its limit, or out of memory)" ;;
    *) if [ "$1" -gt 128 ]; then echo " (killed by SIG$(kill -l $(( $1 - 128 )) 2>/dev/null || echo $(( $1 - 128 ))): a crash, e.g. a CUDA fault)"; fi ;;
  esac
}
step() {  # step NAME LOG LIMIT CMD...: run with a time limit, log, record exit status and seconds
  local name=$1 log=$2 limit=$3; shift 3
  local t0=$SECONDS rc
  log_status "== $name (limit $limit s, at $SECONDS s of $BUDGET_S): $*"
  timeout -k 5 "$limit" "$@" > "$log" 2>&1
  rc=$?
  log_status "   $name exit $rc after $(( SECONDS - t0 )) s$(why "$rc")"
  return $rc
}
left() { echo $(( $1 - SECONDS )); }  # left DEADLINE: seconds from now to DEADLINE (seconds since the start)
min() { if [ "$1" -lt "$2" ]; then echo "$1"; else echo "$2"; fi; }
max() { if [ "$1" -gt "$2" ]; then echo "$1"; else echo "$2"; fi; }

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
{
  date -u
  timeout 60 nvidia-smi 2>&1
  packages 2>&1
  echo "packages exit $?"
  timeout 120 "$PY" -c "import kvlib; kvlib.describe()" 2>&1
} > "$OUT/environment.txt"
cat "$OUT/environment.txt"
if ! grep -qx "packages exit 0" "$OUT/environment.txt"; then
  log_status "$PY lacks torch, triton, numpy or pytest (see environment.txt): nothing to run"
  exit 3
fi
if ! timeout 120 "$PY" -c "import sys, kvlib; sys.exit(kvlib.runtime.mode() != 'gpu')" 2>/dev/null; then
  if [ "${GPU_CHECK_ALLOW_CPU:-0}" != 1 ]; then
    log_status "no CUDA GPU visible to PyTorch with Triton installed: this script needs one"
    exit 2
  fi
  log_status "DRY RUN without a GPU (GPU_CHECK_ALLOW_CPU=1): interpreter mode, for testing this script only"
fi

# The sweeps and their number of points (python -m kvlib.bench --plan), in run order.
plan_args=(--plan)
case $MODE in quick) plan_args+=(--quick) ;; smoke) plan_args+=(--smoke) ;; esac
for name in ${GPU_CHECK_SWEEPS:-}; do plan_args+=(--only "$name"); done
if ! plan=$(timeout 120 "$PY" -m kvlib.bench "${plan_args[@]}" 2> "$OUT/plan.log"); then
  cat "$OUT/plan.log"
  log_status "python -m kvlib.bench ${plan_args[*]} failed (GPU_CHECK_SWEEPS=${GPU_CHECK_SWEEPS:-}; see plan.log)"
  exit 1
fi
NAMES=() POINTS=()
while read -r name points; do  # "NAME POINTS" lines (anything else kvlib printed is not the plan)
  if [[ $points =~ ^[0-9]+$ ]]; then NAMES+=("$name"); POINTS+=("$points"); fi
done <<< "$plan"
if [ ${#NAMES[@]} -eq 0 ]; then
  log_status "python -m kvlib.bench ${plan_args[*]} named no sweep: $plan"
  exit 1
fi
log_status "mode $MODE, budget $BUDGET_S s; sweeps (points):$(for i in "${!NAMES[@]}"; do printf ' %s %s' "${NAMES[i]}" "${POINTS[i]}"; done)"
if [ -n "${KVLIB_BENCH_FAULT:-}" ]; then
  log_status "test hook KVLIB_BENCH_FAULT=$KVLIB_BENCH_FAULT: that sweep's process will die after its first point"
fi

failed=()    # "step exit RC" for each failure
skipped=()   # each step skipped (status.txt says why)
record() {  # record STEP RC
  if [ "$2" -ne 0 ]; then failed+=("$1 exit $2"); fi
}
skip() {  # skip STEP WHY
  skipped+=("$1")
  log_status "   $1 skipped: $2"
}
report() {  # report LOG RC: the log's last lines on a failure, else its closing summary line
  if [ "$2" -ne 0 ]; then tail -n 15 "$1"; else grep -E "rows in|passed|failed" "$1" | tail -n 1; fi
}

# 1. The smoke pass: each sweep at its smallest point, in its own process.
mkdir -p "$OUT/smoke"
smoke_end=$(min $(( SECONDS + SMOKE_BUDGET_S )) $(( BUDGET_S - MERGE_RESERVE_S )))
smoke_timed_out=" "
for name in "${NAMES[@]}"; do
  rest=$(left "$smoke_end")
  if [ "$rest" -lt "$MIN_START_S" ]; then
    skip "smoke $name" "the smoke pass's time is spent ($SECONDS s of the run, $rest s left of its share)"
    continue
  fi
  step "smoke $name" "$OUT/smoke/$name.log" "$(min "$SMOKE_TIMEOUT_S" "$rest")" \
    "$PY" -m kvlib.bench --smoke --only "$name" --out "$OUT/smoke/$name" --no-plots
  rc=$?
  record "smoke $name" "$rc"
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then smoke_timed_out+="$name "; fi
  report "$OUT/smoke/$name.log" "$rc"
done

# 2. Kernel tests, compiled for this GPU. The compile check (static, sm_80/sm_90) and the quick CLI run
#    belong to the CPU suite; the sweeps replace the latter.
if [ "$MODE" = smoke ]; then
  KERNEL_TESTS=(tests/test_vector_add.py)
else
  KERNEL_TESTS=(tests/test_vector_add.py tests/test_attention.py tests/test_cache.py tests/test_paged.py
    tests/test_quant.py tests/test_gqa.py tests/test_generate.py tests/test_evict.py tests/test_lowbit.py tests/test_kivi.py
    tests/test_bench.py tests/test_bench_sweeps.py)
fi
rest=$(left $(( BUDGET_S - MERGE_RESERVE_S )))
if [ "${GPU_CHECK_SKIP_TESTS:-0}" = 1 ]; then
  skip tests "GPU_CHECK_SKIP_TESTS=1"
elif [ "$rest" -lt "$MIN_START_S" ]; then
  skip tests "the budget is spent ($SECONDS s of $BUDGET_S)"
else
  step tests "$OUT/tests.log" "$(min "$TEST_TIMEOUT_S" "$rest")" env -u KVLIB_BENCH_FAULT \
    "$PY" -m pytest "${KERNEL_TESTS[@]}" -m "not bench_cli" -q -p no:cacheprovider -o addopts="" -rfE
  rc=$?
  record tests "$rc"
  tail -n 25 "$OUT/tests.log"
fi
# 2b. Chapter 12a's tp/cp token identity over NCCL (scripts/dist_check.py prints SKIP and exits 0 below 2 GPUs).
rest=$(left $(( BUDGET_S - MERGE_RESERVE_S )))
if [ "$rest" -ge "$MIN_START_S" ]; then
  step dist "$OUT/dist.log" "$(min 300 "$rest")" "$PY" scripts/dist_check.py
  record dist "$?"
fi

# 3. The full (or --quick) sweeps, each in its own process, sharing the rest of the budget by points.
if [ "$MODE" = smoke ]; then
  pass=smoke
else
  pass=sweeps
  mkdir -p "$OUT/sweeps"
  sweeps_end=$(min $(( SECONDS + BENCH_BUDGET_S )) $(( BUDGET_S - MERGE_RESERVE_S )))
  weight_left=0
  for points in "${POINTS[@]}"; do weight_left=$(( weight_left + points + 2 )); done  # +2: a process's start
  for i in "${!NAMES[@]}"; do
    name=${NAMES[$i]} weight=$(( POINTS[i] + 2 ))
    rest=$(left "$sweeps_end")
    if [[ $smoke_timed_out == *" $name "* ]]; then
      skip "sweep $name" "its smoke run timed out (it would hang again)"
    elif [ "$rest" -lt "$MIN_START_S" ]; then
      skip "sweep $name" "the budget is spent ($SECONDS s of $BUDGET_S, $rest s left for the sweeps)"
    else
      share=$(( rest * weight / weight_left ))
      limit=$(min "$rest" "$(max "$(max $(( 2 * share )) $(( share + 30 )))" "$SWEEP_MIN_S")")
      budget=$(max 5 "$(min $(( share - 5 )) $(( limit * 3 / 4 )))")  # 5 s: the process starting and ending
      args=(--only "$name" --out "$OUT/sweeps/$name" --no-plots --budget-s "$budget")
      if [ "$MODE" = quick ]; then args+=(--quick); fi
      step "sweep $name" "$OUT/sweeps/$name.log" "$limit" "$PY" -m kvlib.bench "${args[@]}"
      rc=$?
      record "sweep $name" "$rc"
      report "$OUT/sweeps/$name.log" "$rc"
    fi
    weight_left=$(( weight_left - weight ))
  done
fi

# 4. Merge what the sweeps wrote (a crashed sweep leaves the rows of the points it finished).
parts=()
for name in "${NAMES[@]}"; do
  if [ -f "$OUT/$pass/$name/results.csv" ]; then parts+=("$OUT/$pass/$name"); fi
done
if [ ${#parts[@]} -eq 0 ]; then
  log_status "== merge: no sweep wrote a results.csv: nothing in bench/"
  record merge 1
else
  step merge "$OUT/merge.log" "$MERGE_TIMEOUT_S" "$PY" -m kvlib.bench --merge "${parts[@]}" --out "$OUT/bench"
  rc=$?
  record merge "$rc"
  tail -n 3 "$OUT/merge.log"
fi

listed() {  # listed ITEM...: "" or " (a; b; c)"
  local out="" item
  for item in "$@"; do out+="${out:+; }$item"; done
  if [ -n "$out" ]; then printf ' (%s)' "$out"; fi
}
log_status "done in $SECONDS s (budget $BUDGET_S s): ${#failed[@]} failed$(listed "${failed[@]}"), ${#skipped[@]} skipped$(listed "${skipped[@]}")"
[ ${#failed[@]} -eq 0 ]
