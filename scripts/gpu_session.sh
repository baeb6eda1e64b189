#!/usr/bin/env bash
# One call on a lent GPU (H100/H200; a 10-minute command limit, at most 8 files fetched back): run one part of the
# GPU evidence and pack every report and log into $OUT/gpu_session.tgz (rewritten after each step, so a call cut
# by its time limit still returns what finished). Runs from the repository root, in the interpreter that has
# torch + triton; installs nothing but the carried wheels in .whl/ (nox; see ../shared/wheels/README.md).
#
#   bash scripts/gpu_session.sh checks [seconds]   conformance-gpu (nox, fp32 + bf16), then the kernel tests and
#                                                  the parity suite's range-kernel runs (pytest-xdist)
#   bash scripts/gpu_session.sh range [seconds]    only the range-kernel, top-n, gated-sum and packed-kernel tests and
#                                                  the parity suite's range-kernel runs (after a kernel change)
#   bash scripts/gpu_session.sh perf [seconds]     perf sweep of SDPA, nsa (torch path) and nsa[range_backend=triton]:
#                                                  packed documents, then the single sequence, one results folder
#   bash scripts/gpu_session.sh gate [seconds]     the launch gate end to end for configs/prod-125m.yaml on the local
#                                                  corpus (carry data/sentinels): env guard, nox -s preflight with
#                                                  both GPU gates at once (the sentinels-gpu report is issue 5's GPU
#                                                  run), then a launch with another config hash (must be refused) and
#                                                  the authorized launch, stopped by .HALT after a few steps
#   bash scripts/gpu_session.sh select [seconds]   GPU parity of the fused top-n and Eq. 5 kernels, then a sweep of the
#                                                  whole layer (SDPA vs range_backend=triton), 8k-128k, fwd and fwd+bwd
#   bash scripts/gpu_session.sh sweep [seconds]    after a prefill kernel change: the small-config parity of the range
#                                                  kernels, then the whole layer (SDPA vs range_backend=triton) at
#                                                  8k-128k, fwd and fwd+bwd, and every stage at 64k, merged into a copy
#                                                  of reports/perf, with the baseline rewritten from the merged rows
#   bash scripts/gpu_session.sh profile [seconds]  where the prefill layer's time goes: perf.prefill_probe (group-scores and
#                                                  range tilings, scoring-chunk budgets, backward D and dk/dv tilings
#                                                  at 64k) and perf.layer_profile (kernel by kernel, 8k and 64k forward,
#                                                  64k forward + backward)
#   bash scripts/gpu_session.sh decode [seconds]   the decode GPU tests (tests/test_decode_gpu.py: lean step at the
#                                                  paper layout, graphs, Table 4 reads at 64k), the selection
#                                                  probe, the per-kernel decode profile with
#                                                  split variants, then the decode-step benchmark
#                                                  (8k-128k x batch 1, 16) with the time left
#
# COMMIT=<sha> names the commit in the perf metadata (the copied tree has no .git). Unpack locally with
# `tar xzf gpu_session-<mode>.tgz -C <dir>`; reports/README.md says where each file is committed.
set -u
MODE=${1:?usage: gpu_session.sh checks|range|perf|gate|select|sweep|profile|decode [seconds]}
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
      conformance/test_kernel_select_top_n.py conformance/test_kernel_select_top_n_gpu.py \
      conformance/test_kernel_gated_sum.py \
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
      conformance/test_kernel_select_top_n.py conformance/test_kernel_select_top_n_gpu.py \
      conformance/test_kernel_gated_sum.py conformance/test_kernel_selected_attention.py conformance/test_parity_gpu.py \
      -k "test_kernel_range_attention or test_kernel_select_top_n or test_kernel_gated_sum or (test_kernel_selected_attention and packed) or (test_parity_gpu and range and not 8192)" \
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
  sweep)
    COMMIT_ARGS=${COMMIT:+--commit $COMMIT}
    OUT=$STAGE NSA_REPORT_DIR=$STAGE/reports/parity timeout -k 15 120 python3 -m pytest -q -rfE --tb=short \
      -p no:cacheprovider -n 8 conformance/test_parity_gpu.py -k "test_presets_vs_loop_reference and range" \
      > "$STAGE/parity_presets.log" 2>&1
    echo "exit $?" >> "$STAGE/parity_presets.log"
    cp -r reports/perf "$STAGE/perf" && mkdir -p "$STAGE/baselines" && cp reports/baselines/perf-*.json "$STAGE/baselines/"
    pack
    OUT=$STAGE timeout -k 15 $(( $(left) * 2 / 3 )) python3 -m perf run --device cuda --merge --out "$STAGE/perf" \
      $COMMIT_ARGS --impls "sdpa,nsa[range_backend=triton]" --stages none --seq-lens 8k,16k,32k,64k,128k \
      --case-cap 60 --time-budget $(( $(left) * 2 / 3 - 20 )) > "$STAGE/perf_layer.log" 2>&1
    echo "exit $?" >> "$STAGE/perf_layer.log"
    pack
    OUT=$STAGE timeout -k 15 $(( $(left) - 10 )) python3 -m perf run --device cuda --merge --out "$STAGE/perf" \
      $COMMIT_ARGS --impls "nsa[range_backend=triton]" --seq-lens 64k --case-cap 30 --time-budget $(( $(left) - 40 )) \
      --update-baseline --baseline-dir "$STAGE/baselines" > "$STAGE/perf_stages.log" 2>&1
    echo "exit $?" >> "$STAGE/perf_stages.log"
    pack
    ;;
  profile)
    OUT=$STAGE timeout -k 15 $(( $(left) * 3 / 5 )) python3 -m perf.prefill_probe --out "$STAGE/perf" \
      > "$STAGE/prefill_probe.log" 2>&1
    echo "exit $?" >> "$STAGE/prefill_probe.log"
    pack
    OUT=$STAGE timeout -k 15 $(( $(left) / 2 )) python3 -m perf.layer_profile --seq-lens 8k,64k --out "$STAGE/perf" \
      > "$STAGE/layer_profile_fwd.log" 2>&1
    echo "exit $?" >> "$STAGE/layer_profile_fwd.log"
    pack
    OUT=$STAGE timeout -k 15 $(( $(left) - 10 )) python3 -m perf.layer_profile --seq-lens 64k --pass fwd_bwd --top 16 \
      --out "$STAGE/perf" > "$STAGE/layer_profile_fwd_bwd.log" 2>&1
    echo "exit $?" >> "$STAGE/layer_profile_fwd_bwd.log"
    pack
    ;;
  gate)
    # The prod config on the local corpus: the GPU host has no network for FineWeb streaming (docs/runbook.md).
    GATE_ARGS=(--config configs/prod-125m.yaml -o data.source=jsonl -o "data.paths=[data/sentinels/wiki.jsonl]")
    { git log -1 --format='device checkout: %H %s' 2>&1; git status --porcelain --untracked-files=no | head -5; } \
      >> "$STAGE/env.txt"
    python3 -m sentinels env > "$STAGE/env_guard.log" 2>&1
    echo "exit $?" >> "$STAGE/env_guard.log"
    OUT=$STAGE timeout -k 15 $(( $(left) - 50 )) python3 -m nox -s preflight -- "${GATE_ARGS[@]}" --parallel-gates \
      > "$STAGE/preflight.log" 2>&1
    PREFLIGHT=$?
    echo "exit $PREFLIGHT" >> "$STAGE/preflight.log"
    pack
    [ "$PREFLIGHT" -eq 0 ] || { grep -hE "^exit" "$STAGE"/*.log; exit 1; }
    # Another config hash (one override more) has no GO record: the launcher must refuse it.
    python3 -m nox -s launch -- "${GATE_ARGS[@]}" -o train.lr=1e-3 --nproc 1 > "$STAGE/launch_refused.log" 2>&1
    echo "exit $?" >> "$STAGE/launch_refused.log"
    # The authorized launch: torchrun -> sentinels train; .HALT after a few steps stops it after a checkpoint.
    RUN_DIR=runs/prod-125m
    python3 -m nox -s launch -- "${GATE_ARGS[@]}" --nproc 1 > "$STAGE/launch.log" 2>&1 &
    LAUNCHED=$!
    for _ in $(seq 1 $(( $(left) - 30 ))); do
      if [ -f "$RUN_DIR/heartbeat.jsonl" ] && [ "$(wc -l < "$RUN_DIR/heartbeat.jsonl")" -ge 20 ]; then break; fi
      kill -0 $LAUNCHED 2>/dev/null || break
      sleep 1
    done
    touch "$RUN_DIR/.HALT"
    timeout $(( $(left) > 45 ? 45 : ($(left) > 5 ? $(left) - 5 : 1) )) tail --pid=$LAUNCHED -f /dev/null
    echo "exit $?" >> "$STAGE/launch.log"
    mkdir -p "$STAGE/run"
    cp "$RUN_DIR"/*.json "$RUN_DIR"/*.jsonl "$RUN_DIR"/*.csv "$RUN_DIR"/*.yaml "$STAGE/run/" 2>/dev/null
    cp -r "$RUN_DIR/checkpoints/latest.json" "$STAGE/run/" 2>/dev/null
    ls -la "$RUN_DIR" "$RUN_DIR/checkpoints" > "$STAGE/run/listing.txt" 2>&1
    pack
    ;;
  select)
    NSA_REPORT_DIR=$STAGE/reports/parity timeout -k 15 200 python3 -m pytest -q -rfE -p no:cacheprovider -n 8 \
      conformance/test_kernel_select_top_n.py conformance/test_kernel_select_top_n_gpu.py \
      conformance/test_kernel_gated_sum.py > "$STAGE/select_parity.log" 2>&1
    echo "exit $?" >> "$STAGE/select_parity.log"
    pack
    COMMIT_ARGS=${COMMIT:+--commit $COMMIT}
    OUT=$STAGE timeout -k 15 $(( $(left) - 10 )) python3 -m perf run --device cuda $COMMIT_ARGS \
      --impls "sdpa,nsa[range_backend=triton]" --stages none --seq-lens 8k,16k,32k,64k,128k --case-cap 40 \
      --time-budget $(( $(left) - 40 )) > "$STAGE/perf_layer.log" 2>&1
    echo "exit $?" >> "$STAGE/perf_layer.log"
    pack
    ;;
  decode)
    OUT=$STAGE timeout -k 15 $(( $(left) / 2 )) python3 -m pytest -v --tb=short -rfE --durations=15 \
      -p no:cacheprovider -m gpu tests/test_decode_gpu.py > "$STAGE/decode_gpu_tests.log" 2>&1
    echo "exit $?" >> "$STAGE/decode_gpu_tests.log"
    pack
    # the selection's launches alone against the previous single kernel (120 s ran out on its compiles at
    # 749d3cb; perf.decode_cmp_probe, the compressed split's launch shapes, runs by hand); where the step goes per
    # kernel, and the step under other split counts (the policy's neighbours)
    OUT=$STAGE timeout -k 15 240 python3 -m perf.decode_select_probe > "$STAGE/decode_select_probe.log" 2>&1
    echo "exit $?" >> "$STAGE/decode_select_probe.log"
    pack
    OUT=$STAGE timeout -k 15 $(( $(left) / 3 )) python3 -m perf.decode_profile --cases 8192x1,65536x1,65536x16,131072x16 \
      --variants "lists=8,cmp=8,slc=4;win=2" > "$STAGE/decode_profile.log" 2>&1
    echo "exit $?" >> "$STAGE/decode_profile.log"
    pack
    OUT=$STAGE timeout -k 15 $(( $(left) - 10 )) python3 -m perf.decode_bench --budget-s $(( $(left) - 100 )) \
      > "$STAGE/decode_bench.log" 2>&1
    echo "exit $?" >> "$STAGE/decode_bench.log"
    pack
    ;;
  *)
    echo "unknown mode $MODE (checks | range | perf | gate | select | decode)" >&2
    exit 2
    ;;
esac
grep -hE "^(FAILED|ERROR)|passed|failed|^exit|^context" "$STAGE"/*.log | tail -n 60
