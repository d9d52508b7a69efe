#!/usr/bin/env bash
# Every CUDA test at once: the test files that run on a GPU (the kernels natively, the engine's
# under MOELAB_TEST_DEVICE=cuda), in groups run side by side, each under a time limit, so one
# device call checks the whole tree. Correctness only: nothing here is timed.
# Usage: scripts/gpu_tests.sh OUT_DIR [LIMIT_S [GROUP...]]   (OUT_DIR/GROUP.log, OUT_DIR/summary.txt)
# A group past its limit is interrupted as by ^C, so pytest still reports what failed so far;
# each test's name is printed before it runs (-v), so a crash names the test it happened in.
# MAXFAIL (default 6) stops a group after that many failures. JOBS (default 3) groups run at
# once: more share the host's cores (the Triton compiles, the CPU side) and each runs slower.
# On the GPU machine, first the wheels and the editable install, as scripts/gpu_suite.sh says.
set -uo pipefail
out=${1:?output directory}
limit=${2:-300}
shift $(( $# < 2 ? $# : 2 ))
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MOELAB_TEST_DEVICE=cuda
T=(-v -o addopts=-ra --maxfail=${MAXFAIL:-6} --import-mode=append -p no:cacheprovider --tb=short)
k=tests/kernels
e=tests/engine
declare -A groups=(
  [kernels_formats]="$k/test_cuda_real_shapes.py $k/test_fp8_moe.py $k/test_fp8_kv.py
    $k/test_mxfp4_moe.py $k/test_nvfp4_moe.py $k/test_fp4_formats.py $k/test_gpt_oss_experts.py"
  [kernels_rest]="$k --deselect-formats"
  [engine_core]="$e/test_graphs.py $e/test_offload.py $e/test_reference.py $e/test_telemetry.py
    $e/test_attention.py $e/test_preemption.py $e/test_sampling.py $e/test_h2d.py
    $e/test_stepping.py $e/test_prefix_cache.py"
  [engine_hybrid]="$e/test_hybrid.py $e/test_synth_hybrid.py $k/test_gated_deltanet.py"
  [engine_fp8]="$e/test_fp8.py $e/test_fp8_kv.py $e/test_planner.py $e/test_modelopt_mixed.py"
  [engine_fp4]="$e/test_gpt_oss.py $e/test_mxfp4_experts.py $e/test_nvfp4.py"
)
formats=(${groups[kernels_formats]} $k/test_gated_deltanet.py)
names=("$@")
[ ${#names[@]} -gt 0 ] || names=("${!groups[@]}")
for name in "${names[@]}"; do
  if [ -z "${groups[$name]:-}" ]; then
    echo "unknown group $name; the groups: ${!groups[*]}" >&2
    exit 2
  fi
done
for name in "${names[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "${JOBS:-3}" ]; do wait -n; done
  files=(${groups[$name]})
  if [ "${files[1]:-}" = --deselect-formats ]; then  # the rest of tests/kernels
    files=($k)
    for f in "${formats[@]}"; do files+=(--ignore "$f"); done
  fi
  ( t0=$SECONDS
    timeout -s INT -k 30 "$limit" python3 -m pytest "${T[@]}" "${files[@]}" > "$out/$name.log" 2>&1
    rc=$?
    echo "=== $name: exit $rc in $((SECONDS - t0)) s; $(grep -E 'passed|failed|error' \
      "$out/$name.log" | tail -1)" >> "$out/summary.txt" ) &
done
wait
grep -h -E '^(FAILED|ERROR) ' "$out"/*.log >> "$out/summary.txt"
cat "$out/summary.txt"
