#!/usr/bin/env bash
# One call on a lent GPU (H100/H200; a 10-minute command limit, at most 8 files fetched back): run one part of the
# GPU evidence and pack every report and log into $OUT/gpu_session.tgz (rewritten after each step, so a call cut
# by its time limit still returns what finished). Runs from the repository root, in the interpreter that has
# torch + triton; installs nothing but the carried wheels in .whl/ (nox; see ../shared/wheels/README.md).
#
#   bash scripts/gpu_session.sh checks [seconds]   conformance-gpu (nox, fp32 + bf16), then the kernel tests and
#                                                  the parity suite's range-kernel runs (pytest-xdist)
#   bash scripts/gpu_session.sh range [seconds]    only the range-kernel and packed-kernel tests and the parity
#                                                  suite's range-kernel runs (after a kernel change)
#   bash scripts/gpu_session.sh perf [seconds]     perf sweep of SDPA, nsa (torch path) and nsa[range_backend=triton]:
#                                                  packed documents, then the single sequence, one results folder
#   bash scripts/gpu_session.sh decode [seconds]   the decode GPU tests (tests/test_decode_gpu.py: lean step at the
#                                                  paper layout, graphs, Table 4 reads at 64k), then the decode-step
#                                                  benchmark (8k-128k x batch 1, 16) with the time left
#
# COMMIT=<sha> names the commit in the perf metadata (the copied tree has no .git). Unpack locally with
# `tar xzf gpu_session-<mode>.tgz -C <dir>`; reports/README.md says where each file is committed.
set -u
MODE=${1:?usage: gpu_session.sh checks|range|perf|decode [seconds]}
BUDGET=${2:-400}
REAL_OUT=${OUT:?OUT must name the folder whose files come back}
STAGE=$(mktemp -d)
export PYTHONUNBUFFERED=1
STARTED=$(date +%s)

pack() {
  tar czf "$REAL_OUT/.gpu_session-$MODE.tgz" -C "$STAGE" . && mv "$REAL_OUT/.gpu_session-$MODE.tgz" "$REAL_OUT/gpu_session-$MODE.tgz"
}
left() { echo $((BUDGET - ($(date +%s) - STARTED))); }

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
{ nvidia-smi; python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"; } \
  > "$STAGE/env.txt" 2>&1
pack

case "$MODE" in
  checks)
    # conformance-gpu (nox; fp32 then bf16) on its own, then the kernel tests and the parity suite's range-kernel
    # runs: side by side they starve each other of the host CPUs that compile the Triton kernels.
    OUT=$STAGE timeout -k 15 $(( $(left) * 45 / 100 )) python3 -m nox -s conformance-gpu \
      > "$STAGE/conformance_gpu.log" 2>&1
    echo "exit $?" >> "$STAGE/conformance_gpu.log"
    pack
    OUT=$STAGE NSA_REPORT_DIR=$STAGE/reports/parity timeout -k 15 $(( $(left) - 20 )) \
      python3 -m pytest -v --tb=short -rfE --durations=15 -p no:cacheprovider -n 8 \
      conformance/test_kernel_range_attention.py conformance/test_kernel_range_attention_gpu.py \
      conformance/test_kernel_selected_attention.py conformance/test_kernel_selected_attention_gpu.py \
      conformance/test_parity_gpu.py \
      -k "(not test_parity_gpu or (range and not 8192)) and (not test_kernel_selected_attention_gpu or (parity_with_naive and bf16))" \
      > "$STAGE/kernel_and_parity_tests.log" 2>&1
    echo "exit $?" >> "$STAGE/kernel_and_parity_tests.log"
    pack
    ;;
  range)
    OUT=$STAGE NSA_REPORT_DIR=$STAGE/reports/parity timeout -k 15 $(( $(left) - 20 )) \
      python3 -m pytest -v --tb=short -rfE --durations=15 -p no:cacheprovider -n 8 \
      conformance/test_kernel_range_attention.py conformance/test_kernel_range_attention_gpu.py \
      conformance/test_kernel_selected_attention.py conformance/test_parity_gpu.py \
      -k "test_kernel_range_attention or (test_kernel_selected_attention and packed) or (test_parity_gpu and range and not 8192)" \
      > "$STAGE/range_tests.log" 2>&1
    echo "exit $?" >> "$STAGE/range_tests.log"
    pack
    ;;
  perf)
    # A fresh sweep: the default torch path (nsa), the range kernels and SDPA, all in this run, so every ratio in
    # the report compares rows of one run. Packed documents first (short: the whole layer only, 8k-64k), then the
    # single sequence, merged into the same results; a case over --case-cap seconds is skipped and says so.
    COMMIT_ARGS=${COMMIT:+--commit $COMMIT}
    IMPLS="sdpa,nsa,nsa[range_backend=triton]"
    OUT=$STAGE timeout -k 15 100 python3 -m perf run --device cuda $COMMIT_ARGS --workload packed --impls "$IMPLS" \
      --stages none --seq-lens 8k,16k,32k,64k --case-cap 10 --time-budget 70 > "$STAGE/perf_packed.log" 2>&1
    echo "exit $?" >> "$STAGE/perf_packed.log"
    pack
    OUT=$STAGE timeout -k 15 $(( $(left) - 10 )) python3 -m perf run --device cuda --merge $COMMIT_ARGS \
      --impls "$IMPLS" --case-cap 15 --time-budget $(( $(left) - 70 )) --update-baseline \
      > "$STAGE/perf_single.log" 2>&1
    echo "exit $?" >> "$STAGE/perf_single.log"
    pack
    ;;
  decode)
    OUT=$STAGE timeout -k 15 $(( $(left) / 2 )) python3 -m pytest -v --tb=short -rfE --durations=15 \
      -p no:cacheprovider -m gpu tests/test_decode_gpu.py > "$STAGE/decode_gpu_tests.log" 2>&1
    echo "exit $?" >> "$STAGE/decode_gpu_tests.log"
    pack
    OUT=$STAGE timeout -k 15 $(( $(left) - 10 )) python3 -m perf.decode_bench --budget-s $(( $(left) - 100 )) \
      > "$STAGE/decode_bench.log" 2>&1
    echo "exit $?" >> "$STAGE/decode_bench.log"
    pack
    ;;
  *)
    echo "unknown mode $MODE (checks | range | perf | decode)" >&2
    exit 2
    ;;
esac
grep -hE "^(FAILED|ERROR)|passed|failed|^exit|^context" "$STAGE"/*.log | tail -n 60
