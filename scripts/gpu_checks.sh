#!/usr/bin/env bash
# The GPU test suites and benchmarks, one step after another, on any machine with a CUDA GPU.
#
#   bash scripts/gpu_checks.sh [--out DIR] [--time-limit SECONDS] [--workers N] [--python PYTHON] [--dry-run]
#                              [STEP ...]
#
# Steps (default: all of them, in this order):
#   conformance-gpu  the conformance properties on CUDA tensors, fp32 and bf16 (nox -s conformance-gpu)
#                    -> DIR/conformance/
#   gpu-tests        every test marked gpu: kernel and layer parity against float64 oracles, decode on the GPU
#                    -> DIR/parity/
#   kernels          the Triton kernel test suites (which CI runs in Triton's interpreter) compiled for this GPU
#   sentinels-gpu    the sentinel suite, GPU profile (nox -s sentinels-gpu) -> DIR/sentinels/
#   perf             prefill benchmark against SDPA (nox -s perf): compared with reports/baselines/ when it holds a
#                    baseline for this GPU; this run's results -> DIR/perf/, its rows as a baseline -> DIR/baselines/
#   decode-bench     decode-step latency against SDPA decode (python -m perf.decode_bench) -> DIR/decode/
#
# Options:
#   --out DIR             where every report and log goes (default: reports/gpu-checks, ignored by git)
#   --time-limit SECONDS  wall-clock limit of each step (default: 3600; 0: none); the benchmarks get it, less a
#                         minute, as their own budget, so they skip the cases that would not fit and still write
#   --workers N           pytest-xdist workers for gpu-tests and kernels (default: 1). More workers share the
#                         Triton compiles and the float64 references' CPU work; each holds its own GPU memory
#   --python PYTHON       the interpreter to run (default: python3)
#   --dry-run             print the commands without running them
#
# Runs in the given interpreter's environment and installs nothing: it needs torch with CUDA, triton and the
# project's extras (`python -m pip install -e ".[dev,data,plots]"` next to a CUDA build of torch). Each step's
# output goes to the terminal and to DIR/logs/<step>.log; DIR/logs/summary.txt lists every step's verdict and
# time, DIR/logs/environment.txt the GPU, the versions and the commit. Steps run one at a time: side by side they
# would compete for the host CPUs that compile the Triton kernels.
# Exit status: 0 when every step passed; 1 when a step failed or reached its time limit; 2 on bad usage or when
# the interpreter sees no CUDA GPU.
set -u
cd "$(dirname "$0")/.."

ALL_STEPS=(conformance-gpu gpu-tests kernels sentinels-gpu perf decode-bench)
KERNEL_TESTS=tests/kernels  # the Triton kernel suites

OUT_DIR=reports/gpu-checks
TIME_LIMIT=3600
WORKERS=1
PYTHON=python3
DRY_RUN=0
STEPS=()

usage() { sed -n '2,/^set -u$/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }
die() { echo "gpu_checks.sh: $*" >&2; exit 2; }
is_count() { [[ $1 =~ ^[0-9]+$ ]]; }

while [ $# -gt 0 ]; do
  case "$1" in
    --out) [ $# -ge 2 ] || die "--out needs a folder"; OUT_DIR=$2; shift 2 ;;
    --time-limit) { [ $# -ge 2 ] && is_count "$2"; } || die "--time-limit needs a whole number of seconds"
                  TIME_LIMIT=$2; shift 2 ;;
    --workers) { [ $# -ge 2 ] && is_count "$2" && [ "$2" -ge 1 ]; } || die "--workers needs a count >= 1"
               WORKERS=$2; shift 2 ;;
    --python) [ $# -ge 2 ] || die "--python needs an interpreter"; PYTHON=$2; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) [[ " ${ALL_STEPS[*]} " == *" $1 "* ]] || die "unknown step $1 (steps: ${ALL_STEPS[*]})"
       STEPS+=("$1"); shift ;;
  esac
done
[ ${#STEPS[@]} -gt 0 ] || STEPS=("${ALL_STEPS[@]}")

# A benchmark's own budget: the step's limit less a minute for writing its results (none without a limit).
budget_args() {  # flag name
  if [ "$TIME_LIMIT" -gt 120 ]; then echo "$1 $((TIME_LIMIT - 60))"; fi
}
xdist_args() {
  if [ "$WORKERS" -gt 1 ]; then echo "-n $WORKERS"; fi
}
PYTEST=("$PYTHON" -m pytest -q -rfE --durations=15 -p no:cacheprovider)
show() { printf '%q ' "$@" | sed 's/ $//'; }

step_command() {  # step name -> the command, one word per line
  case "$1" in
    conformance-gpu) printf '%s\n' "$PYTHON" -m nox -s conformance-gpu -- --report-dir "$OUT_DIR/conformance" ;;
    gpu-tests) printf '%s\n' "${PYTEST[@]}" -m gpu --gpu-report-dir "$OUT_DIR/parity" $(xdist_args) ;;
    kernels) printf '%s\n' "${PYTEST[@]}" -m "not gpu" $(xdist_args) "$KERNEL_TESTS" ;;
    sentinels-gpu) printf '%s\n' "$PYTHON" -m nox -s sentinels-gpu -- --out "$OUT_DIR/sentinels" ;;
    perf) printf '%s\n' "$PYTHON" -m nox -s perf -- --out "$OUT_DIR/perf" --update-baseline \
            --baseline-dir "$OUT_DIR/baselines" $(budget_args --time-budget) ;;
    decode-bench) printf '%s\n' "$PYTHON" -m perf.decode_bench --out "$OUT_DIR/decode" $(budget_args --budget-s) ;;
  esac
}

if [ "$DRY_RUN" = 1 ]; then
  for step in "${STEPS[@]}"; do
    mapfile -t cmd < <(step_command "$step")
    echo "$step: $(show "${cmd[@]}")"
  done
  exit 0
fi

probe='import sys, torch; print(torch.__version__); sys.exit(0 if torch.cuda.is_available() else 3)'
torch_version=$("$PYTHON" -c "$probe" 2>/dev/null)
case $? in
  0) ;;
  3) die "$PYTHON sees no CUDA GPU (torch $torch_version); these checks need one" ;;
  *) die "torch does not import in $PYTHON; run with --python pointing at the environment that has torch with CUDA" ;;
esac

LOGS="$OUT_DIR/logs"
mkdir -p "$LOGS" || die "cannot create $LOGS"
SUMMARY="$LOGS/summary.txt"
export PYTHONUNBUFFERED=1  # the logs follow the run as it goes
{
  command -v nvidia-smi >/dev/null && nvidia-smi
  "$PYTHON" -c 'import platform, torch, triton
print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| triton", triton.__version__, "|", torch.cuda.get_device_name())'
  git rev-parse HEAD 2>/dev/null && git status --porcelain --untracked-files=no | head -20
} > "$LOGS/environment.txt" 2>&1
: > "$SUMMARY"

FAILED=0
for step in "${STEPS[@]}"; do
  mapfile -t cmd < <(step_command "$step")
  log="$LOGS/$step.log"
  echo "== $step: $(show "${cmd[@]}")"
  echo "\$ $(show "${cmd[@]}")" > "$log"
  started=$SECONDS
  timeout --kill-after=30 "$TIME_LIMIT" "${cmd[@]}" 2>&1 | tee -a "$log"
  status=${PIPESTATUS[0]}
  verdict=PASS
  if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
    verdict="TIME LIMIT"
  elif [ "$status" -ne 0 ]; then
    verdict=FAIL
  fi
  [ "$verdict" = PASS ] || FAILED=1
  printf '%-16s %-10s exit %-3s %6d s  %s\n' "$step" "$verdict" "$status" $((SECONDS - started)) "$log" \
    | tee -a "$SUMMARY"
done

echo
echo "GPU checks, reports in $OUT_DIR/:"
cat "$SUMMARY"
exit $FAILED
