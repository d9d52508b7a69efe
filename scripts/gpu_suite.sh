#!/usr/bin/env bash
# The GPU run: kernel and engine tests on CUDA, then every benchmark docs/performance.md quotes.
# Usage: scripts/gpu_suite.sh OUT_DIR [tests|engine|decode|resident|offload|crossover|startup|autotune|machine|prefill|attention|guess|redo|redo_busy|ahead|ahead_rows|eager|drawn|cut|rows25|prefix|all]
# (tests, then resident: the first GPU runs after hot-path changes, each under 10 minutes)
# On the device machine (torch and triton preinstalled), first the wheels of
# scripts/device_wheels.sh (carry .whl) on PYTHONPATH, then
# `python3 -m pip install --no-deps --no-build-isolation -e .` (it has no index to build from).
set -uo pipefail
out=${1:?output directory}
part=${2:-all}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
run() {  # name, command...: keep going when one step fails, record its status
  local name=$1; shift
  echo "=== $name: $*" | tee -a "$out/summary.txt"
  local t0=$SECONDS
  "$@" > "$out/$name.log" 2>&1
  echo "=== $name: exit $? in $((SECONDS - t0)) s" | tee -a "$out/summary.txt"
  grep -E "^(decode|prefill) |^runs |passed|failed|b_over_a|^alternated |^(paged_attention|fused_moe_decode) " \
    "$out/$name.log" \
    | tail -5 | tee -a "$out/summary.txt"
}
nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.max,pcie.link.width.max,driver_version \
  --format=csv > "$out/gpu.txt" 2>&1
python3 -c 'import torch, triton; print(torch.__version__, triton.__version__)' >> "$out/gpu.txt"
B="python3 -m moelab.engine.cli bench"
G="--preset qwen3-30b-a3b --set num_hidden_layers=12"
if [ "$part" = tests ] || [ "$part" = all ]; then
  T='-o addopts=-ra --import-mode=append -p no:cacheprovider'  # the root behind site-packages
  run kernel_tests python3 -m pytest -q tests/kernels $T
  run engine_tests_cuda env MOELAB_TEST_DEVICE=cuda python3 -m pytest -q $T --tb=short \
    tests/engine/test_graphs.py tests/engine/test_offload.py tests/engine/test_reference.py \
    tests/engine/test_telemetry.py tests/engine/test_attention.py
fi
if [ "$part" = redo ]; then  # idle CPU workers running again a task whose worker stalled: its
  # tests, runs alternating never (0) and the default 150 us in one process (three processes),
  # then the 25%-cache rows with the default flags
  T='-o addopts=-ra --import-mode=append -p no:cacheprovider'
  run redo_tests python3 -m pytest -q $T tests/kernels/test_cpu_experts.py \
    tests/engine/test_planner.py tests/engine/test_cli.py::test_bench_decode_alternates_a_cpu_flag
  run redo_engine_cuda env MOELAB_TEST_DEVICE=cuda python3 -m pytest -q $T --tb=short \
    tests/engine/test_graphs.py tests/engine/test_offload.py
  for i in 1 2 3; do
    run redo_alternate_$i $B decode $G --routing-skew 1 --moe-cache-rate 0.25 --tokens 256 \
      --repeats 12 --moe-cpu-redo-us 0 --alternate-cpu-redo-us 150 --json
  done
  run redo_cache25_skew1 $B decode $G --routing-skew 1 --moe-cache-rate 0.25 --tokens 256 \
    --repeats 3 --json
  run redo_cache25_skew0 $B decode $G --routing-skew 0 --moe-cache-rate 0.25 --tokens 256 \
    --repeats 3 --json
fi
if [ "$part" = ahead ]; then  # the guessed first device miss copied ahead of the routing: its
  # tests (the planner's and the engine's on CUDA), then runs alternating off (0) and 0.75 in
  # one process (two processes)
  T='-o addopts=-ra --import-mode=append -p no:cacheprovider'
  run ahead_tests python3 -m pytest -q $T tests/engine/test_planner.py
  run ahead_engine_cuda env MOELAB_TEST_DEVICE=cuda python3 -m pytest -q $T --tb=short \
    tests/engine/test_graphs.py tests/engine/test_offload.py
  for i in 1 2; do  # short runs, many pairs: the host drifts within a process
    run ahead_alternate_$i $B decode $G --routing-skew 1 --moe-cache-rate 0.25 --tokens 128 \
      --repeats 24 --moe-copy-ahead 0 --alternate-copy-ahead 0.75 --json
  done
fi
if [ "$part" = ahead_rows ]; then  # one more alternation, one against a share of 0.5, then the
  # 25%-cache rows (default flags)
  run ahead_alternate_3 $B decode $G --routing-skew 1 --moe-cache-rate 0.25 --tokens 128 \
    --repeats 24 --moe-copy-ahead 0 --alternate-copy-ahead 0.75 --json
  run ahead_alternate_half $B decode $G --routing-skew 1 --moe-cache-rate 0.25 --tokens 128 \
    --repeats 24 --moe-copy-ahead 0 --alternate-copy-ahead 0.5 --json
  run ahead_cache25_skew1 $B decode $G --routing-skew 1 --moe-cache-rate 0.25 --tokens 256 \
    --repeats 3 --json
  run ahead_cache25_skew0 $B decode $G --routing-skew 0 --moe-cache-rate 0.25 --tokens 256 \
    --repeats 3 --json
fi
if [ "$part" = eager ]; then  # the eager decode steps' attention at the graphs' width: its CUDA
  # test and the compile test, then two processes of 24 runs (their seventeenth run holds the
  # telemetry's phase-timed step: compiled 0), alternating the copies ahead at 0.75 and 1.0
  T='-o addopts=-ra --import-mode=append -p no:cacheprovider'
  run eager_tests env MOELAB_TEST_DEVICE=cuda python3 -m pytest -q $T --tb=short \
    tests/kernels/test_compile_variants.py tests/engine/test_graphs.py -k "eager or cuda or compiles"
  for i in 1 2; do
    run eager_alternate_$i $B decode $G --routing-skew 1 --moe-cache-rate 0.25 --tokens 128 \
      --repeats 24 --moe-copy-ahead 0.75 --alternate-copy-ahead 1.0 --json
  done
fi
if [ "$part" = drawn ]; then  # tokens drawn on the GPU in the decode graphs: their CUDA tests,
  # then decode greedy, drawn (overlapped) and drawn by the host's sampler (--no-overlap-decode,
  # the path every drawn request took before), resident at batch 1 and 8, and offloaded
  T='-o addopts=-ra --import-mode=append -p no:cacheprovider'
  run drawn_tests env MOELAB_TEST_DEVICE=cuda python3 -m pytest -q $T --tb=short \
    tests/kernels/test_draw.py tests/kernels/test_hopper_compile.py tests/engine/test_sampling.py
  run drawn_engine_tests env MOELAB_TEST_DEVICE=cuda python3 -m pytest -q $T --tb=short \
    tests/engine/test_graphs.py -k "draw or overlapped_decode_on_cuda"
  run drawn_kernels python3 -m moelab.kernels.bench --only draw
  D="--temperature 0.8 --top-p 0.95"  # the sort's cut
  Q="--temperature 0.6 --top-p 0.95 --top-k 20"  # Qwen3's defaults: the top-k's cut
  for b in 1 8; do
    run drawn_resident_b${b}_greedy $B decode $G --routing-skew 1 --batch $b --json
    run drawn_resident_b${b} $B decode $G --routing-skew 1 --batch $b $D --json
    run drawn_resident_b${b}_top_k $B decode $G --routing-skew 1 --batch $b $Q --json
    run drawn_resident_b${b}_host $B decode $G --routing-skew 1 --batch $b $Q --json \
      --no-overlap-decode
  done
  run drawn_cache25_greedy $B decode $G --routing-skew 1 --moe-cache-rate 0.25 --json
  run drawn_cache25_top_k $B decode $G --routing-skew 1 --moe-cache-rate 0.25 $Q --json
  run drawn_cache25_host $B decode $G --routing-skew 1 --moe-cache-rate 0.25 $Q --json \
    --no-overlap-decode
fi
if [ "$part" = cut ]; then  # the draws' cuts (sampling.Cut): the draw tests on CUDA, the
  # kernels' rows, then decode at Qwen3's sampling defaults (the top-k's cut), batch 1 and 8
  T='-o addopts=-ra --import-mode=append -p no:cacheprovider'
  run cut_tests env MOELAB_TEST_DEVICE=cuda python3 -m pytest -q $T --tb=short \
    tests/kernels/test_draw.py tests/engine/test_sampling.py
  run cut_engine_tests env MOELAB_TEST_DEVICE=cuda python3 -m pytest -q $T --tb=short \
    tests/engine/test_graphs.py -k draw
  run cut_kernels python3 -m moelab.kernels.bench --only draw
  Q="--temperature 0.6 --top-p 0.95 --top-k 20"
  for b in 1 8; do
    run cut_resident_b${b}_top_k $B decode $G --routing-skew 1 --batch $b $Q --json
  done
fi
if [ "$part" = rows25 ]; then  # the 25%-cache rows at routing skew 1 and 0, default flags
  for skew in 1 0; do
    run rows25_skew$skew $B decode $G --routing-skew $skew --moe-cache-rate 0.25 --tokens 256 \
      --repeats 3 --json
  done
fi
if [ "$part" = prefix ]; then  # a multi-turn chat's time to first token, with the prefix cache
  # and without, all resident and with a 25% expert cache
  for rate in 1.0 0.25; do
    run prefix_ttft_$rate python3 scripts/prefix_cache_ttft.py --preset qwen3-30b-a3b \
      --set num_hidden_layers=12 --system 4096 --question 128 --device cuda \
      --moe-cache-rate $rate --log-level warning
  done
fi
if [ "$part" = redo_busy ]; then  # the same alternation with another program busy on CPU 3 (a
  # worker's core under --moe-cpu-pin cores), as on a desktop running something else
  taskset -c 3 python3 -c 'while True: pass' &
  hog=$!
  for i in 1 2 3; do
    run redo_busy_alternate_$i $B decode $G --routing-skew 1 --moe-cache-rate 0.25 --tokens 256 \
      --repeats 8 --moe-cpu-redo-us 0 --alternate-cpu-redo-us 150 --json
  done
  kill $hog
fi
if [ "$part" = resident ]; then  # all experts resident: overlapped decode against waiting steps
  run decode12_resident_skew1 $B decode $G --routing-skew 1 --json
  run decode12_resident_skew1_sync $B decode $G --routing-skew 1 --json --no-overlap-decode
  run decode12_resident_b8 $B decode $G --routing-skew 1 --batch 8 --json
  run decode12_resident_profile $B decode $G --routing-skew 1 --json --kernel-profile
  run decode12_cache25_skew1 $B decode $G --routing-skew 1 --moe-cache-rate 0.25 --json
fi
if [ "$part" = guess ]; then  # the CPU workers' prefetch of guessed blocks: its tests, then
  # runs alternating 0 and 2 rounds in one process (two processes), the host's drift shared
  run guess_tests python3 -m pytest -q -o "addopts=-ra --import-mode=append" -p no:cacheprovider \
    tests/kernels/test_route_guess.py tests/engine/test_planner.py tests/engine/test_graphs.py \
    tests/engine/test_cli.py -k "planner or graphs or guess or alternat or cuda"
  for i in 1 2; do
    run guess_alternate_$i $B decode $G --routing-skew 1 --moe-cache-rate 0.25 --tokens 256 \
      --repeats 16 --alternate-prefetch-rounds 2 --json
  done
fi
if [ "$part" = prefill ]; then  # pp512 in three processes (a host-bound prefill varies by process)
  for i in 1 2 3; do
    run prefill12_resident_$i $B prefill $G --prompt-tokens 512 --repeats 10 --json
  done
  run prefill12_resident_2048 $B prefill $G --prompt-tokens 2048 --repeats 5 --json
  run prefill12_cache25 $B prefill $G --prompt-tokens 512 --moe-cache-rate 0.25 --json
fi
if [ "$part" = attention ]; then  # decode attention's rows twice, with programmatic dependent launch and without
  for i in 1 2; do
    run attention_pdl_$i python3 -m moelab.kernels.bench --only paged_attention,fused_moe
    run attention_nopdl_$i env MOELAB_PDL=0 python3 -m moelab.kernels.bench --only paged_attention,fused_moe
  done
fi
if [ "$part" = startup ] || [ "$part" = autotune ]; then  # an engine's start, phase by phase
  run synth_small python3 -m moelab.engine.cli synth --arch qwen3_moe --preset small --out /tmp/small
  run serve_small_start python3 scripts/serve_start.py /tmp/small 3
fi
if [ "$part" = engine ] || [ "$part" = decode ] || [ "$part" = all ]; then
  run decode12_resident_skew1 $B decode $G --routing-skew 1 --json --kernel-profile
  # the offloaded rows: three runs of 256 tokens each in one process (the host's rate varies run
  # to run, and one stall of the host weighs less in a longer run)
  O="--moe-cache-rate 0.25 --json --repeats 3 --tokens 256"
  run decode12_cache25_skew1 $B decode $G --routing-skew 1 $O
  run decode12_resident_skew0 $B decode $G --routing-skew 0 --json
  run decode12_cache25_skew0 $B decode $G --routing-skew 0 $O
  run decode12_resident_b8 $B decode $G --routing-skew 1 --batch 8 --json
  run decode12_cache25_b8 $B decode $G --routing-skew 1 --batch 8 --moe-cache-rate 0.25 --json
  run prefill12_resident $B prefill $G --prompt-tokens 512 --json
  run prefill12_cache25 $B prefill $G --prompt-tokens 512 --moe-cache-rate 0.25 --json
fi
if [ "$part" = machine ] || [ "$part" = all ]; then
  run kernels_bench python3 -m moelab.kernels.bench
  run bw $B bw --threads 1,4,8,15,16 --json
  run cpu_experts_bench python3 -m moelab.kernels.cpu_experts_bench --threads 1,4,8,16
  run decode48_resident $B decode --preset qwen3-30b-a3b --routing-skew 1 --json
  run decode48_cache25 $B decode --preset qwen3-30b-a3b --routing-skew 1 --moe-cache-rate 0.25 --json
fi
if [ "$part" = offload ]; then  # the offloaded decode step, with the CPU workers' own timings
  C="$G --routing-skew 1 --moe-cache-rate 0.25 --json"
  run decode12_cache25_skew1 $B decode $C
  run decode12_cache25_skew1_cpu $B decode $C --moe-miss-policy cpu
  run decode12_cache25_skew1_t8 $B decode $C --moe-cpu-threads 8
  run decode12_cache25_skew1_profile $B decode $C --profile
  run decode12_cache25_skew1_trace $B decode $C --kernel-profile --trace "$out/trace.json"
  run decode12_timeline python3 scripts/decode_timeline.py "$out/trace.json"
fi
if [ "$part" = crossover ] || [ "$part" = all ]; then  # the bw profile first: the crossover joins it
  run bw_profile $B bw --json
  run prefill12_crossover $B prefill $G --moe-cache-rate 0.25 --crossover --json
fi
if [ "$part" = autotune ]; then  # trial overhead of the benchmark, small preset, standard's target
  run autotune_small python3 -m moelab.autotune --model-path /tmp/small --mode quick \
    --target-s 60 --objective decode --only no-overlap-decode --out "$out/autotune_small.json"
fi
