#!/usr/bin/env bash
# The GPU run: kernel and engine tests on CUDA, then every benchmark docs/performance.md quotes.
# Usage: scripts/gpu_suite.sh OUT_DIR [tests|engine|decode|resident|offload|timeline|resident_timeline|early|early_hybrid|crossover|startup|autotune|machine|prefill|attention|drawn|rows25|prefix|agent|compare|cpu_formats|fp8|fp8_linear|fp8kv|fp8kv_context|fp8engine|fp8engine48|gptoss|gptoss_context|admission|mxfp4|ncu_moe|hybrid|split|all]
# compare: BEFORE=DIR holding an older tree's engine/ kernels/ profiles/ autotune/ (as
# `git archive REV engine kernels profiles autotune | tar -x -C DIR` writes them); its rows and
# this tree's, process by process in turn, ROUNDS times (default 2); CASES picks the rows
# (tests, then resident: the first GPU runs after hot-path changes, each under 10 minutes)
# compare's CASES: resident_b1 resident_b8 cache25_skew0 cache25_skew1 prefill512 (the default),
# prefill512_skew1, resident_fp8_b1 (FP8 experts and projections), fp8_48_24g_skew1,
# hybrid_fp8_b1 (Qwen3.6-35B-A3B on 24 GiB)
# hybrid: issue 53's rows at Qwen3.6-35B-A3B's geometry; its parts hybrid_tests, hybrid_decode,
# hybrid_context, hybrid_prefill, hybrid_262k and hybrid_turns one at a time, each under 10
# minutes; DTYPES (default "bf16 fp8") the expert formats, HYBRID (default "--preset
# qwen3.6-35b-a3b") the model, CONTEXTS (default "32768 131072") hybrid_context's prompts
# On the GPU machine (torch and triton preinstalled), first the wheels of
# scripts/device_wheels.sh (carry .whl) on PYTHONPATH, then
# `python3 -m pip install --no-deps --no-build-isolation -e .` (it has no index to build from).
# A fresh machine calibrates the routers of each geometry it runs with dummy weights (45-54 s at
# Qwen3.6-35B-A3B's), kept under $XDG_CACHE_HOME/moelab/calibrations (a few small JSON files,
# keyed by what they depend on: remade where anything differs). A call that exports
# XDG_CACHE_HOME=$PWD/.devcache and copies that folder into $OUT/devcache brings them back, for
# .devcache/moelab/calibrations (ignored by git) to be carried into the next call. The native
# kernel's build (25-40 s) is kept there too but does not come back (its folder is too deep).
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
  grep -E "^(decode|prefill) |^runs |passed|failed|b_over_a|^alternated |^session: |^(paged_attention|fused_moe_decode|grouped_moe|short_conv|delta_rule|linear_decode|cublas_linear)" \
    "$out/$name.log" \
    | tail -5 | tee -a "$out/summary.txt"
}
context_share() {  # name, label: a context proof's prompt against the context advertised
  # (and the decode rate after it, where the run decoded), from the JSON ending name's log
  tail -1 "$out/$1.log" | python3 -c 'import json, sys
r = json.load(sys.stdin)
n, ctx, rate = r["prompt_tokens"], r["max_context"], r.get("decode_tok_s")
after = f"; then {rate:.1f} tok/s" if rate else ""
print(f"{sys.argv[1]}: a prompt of {n} tokens served, {n / ctx:.1%} of the advertised {ctx}{after}")' \
    "$2" | tee -a "$out/summary.txt"
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
    tests/engine/test_telemetry.py tests/engine/test_attention.py tests/engine/test_hybrid.py \
    tests/engine/test_preemption.py
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
if [ "$part" = fp8 ]; then  # the MoE kernels over FP8 expert banks: their tests (the small ones
  # natively, the real shapes in bf16, the compile for sm_90, sm_86 and sm_75), then the decode
  # and prefill rows of both banks, bf16 and FP8
  T='-o addopts=-ra --import-mode=append -p no:cacheprovider'
  run fp8_tests python3 -m pytest -q $T --tb=short tests/kernels/test_fp8_moe.py \
    tests/kernels/test_hopper_compile.py
  run fp8_cuda_tests python3 -m pytest -q $T --tb=short tests/kernels/test_cuda_real_shapes.py \
    -k fp8
  run fp8_kernels python3 -m moelab.kernels.bench \
    --only fused_moe,fused_moe_fp8,grouped_moe,grouped_moe_fp8
fi
if [ "$part" = fp8_linear ]; then  # the decode projections over FP8 weights: their tests (the
  # interpreter's shapes natively, qkv and o in bf16, the engine's FP8 projections on CUDA),
  # then their rows beside bf16's, the FP8 kernel's tiles, and decode with and without FP8
  # projections (whether --dense-dtype fp8 should become the default)
  T='-o addopts=-ra --import-mode=append -p no:cacheprovider'
  run fp8_linear_tests python3 -m pytest -q $T --tb=short tests/kernels/test_gemv.py -k fp8
  run fp8_dense_tests_cuda env MOELAB_TEST_DEVICE=cuda python3 -m pytest -q $T --tb=short \
    tests/engine/test_dense_fp8.py
  run fp8_linear_kernels python3 -m moelab.kernels.bench --only linear,linear_fp8
  run fp8_linear_sweep python3 -m moelab.kernels.bench --sweep --only linear_fp8
  # FP8 experts with the projections in the compute dtype, then in FP8 (--dense-dtype fp8):
  # 12 layers all resident (issue 52's 1.3x over bf16), then 48 on 24 GiB offloaded
  F="--routing-skew 1 --moe-expert-dtype fp8 --json"
  # the bf16 experts' row, the ratio's other side, in the same call
  run fp8_dense_bf16_experts_resident $B decode $G --routing-skew 1 --moe-expert-dtype bf16 \
    --json --tokens 256 --repeats 3
  for dense in auto fp8; do
    run fp8_dense_${dense}_resident $B decode $G $F --tokens 256 --repeats 3 --dense-dtype $dense
  done
  for dense in auto fp8; do
    run fp8_dense_${dense}_48 $B decode --preset qwen3-30b-a3b --device-memory 24GiB $F \
      --tokens 128 --repeats 2 --dense-dtype $dense
  done
fi
if [ "$part" = ncu_moe ]; then  # Nsight Compute over the one-token decode MoE launches of each
  # expert format (scripts/moe_kernel_ncu.py): each launch's time, DRAM rate, occupancy and what
  # its warps wait on, at Qwen3-30B-A3B's and gpt-oss-120b's expert shapes; then the 4-bit
  # launches at each of FP4_TILES (gate/up rows x step, down rows x step, warps, gate/up's stages
  # and down's). The clocks are left alone; each launch runs from a flushed L2 (ncu's default)
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null \
    | head -1)
  N="$NCU --clock-control none -k regex:one_token|_fp4_ --section SpeedOfLight
    --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats
    --section SchedulerStats --section WarpStateStats
    --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,dram__bytes_read.sum,smsp__inst_executed.sum"
  run ncu_moe_qwen3 $N python3 scripts/moe_kernel_ncu.py --calls 2
  run ncu_moe_gpt_oss $N python3 scripts/moe_kernel_ncu.py --calls 2 --shape gpt-oss \
    --formats bf16,fp8,mxfp4
  for tiles in ${FP4_TILES:-16x512,16x1024,4w,3s,1ds 16x512,16x512,4w,3s,1ds 16x512,16x512,4w,3s,3ds}; do
    run ncu_fp4_tiles_${tiles//,/_} $NCU --clock-control none -k regex:_fp4_ \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
      python3 scripts/moe_kernel_ncu.py --calls 2 --formats mxfp4,nvfp4 --fp4-tiles $tiles
  done
fi
if [ "$part" = mxfp4 ]; then  # the MoE kernels over MXFP4 expert banks: their tests natively
  # (the small ones, bf16, gpt-oss's shapes, a CUDA graph), then the decode and prefill rows of
  # the bf16 and MXFP4 banks, and the CPU kernel's share of the host's read rate at gpt-oss's
  # expert shape
  T='-o addopts=-ra --import-mode=append -p no:cacheprovider'
  run mxfp4_tests python3 -m pytest -q $T --tb=short tests/kernels/test_mxfp4_moe.py \
    tests/kernels/test_nvfp4_moe.py tests/kernels/test_fp4_formats.py
  # the engine on MXFP4 slots: gpt_oss's MXFP4 checkpoint and qwen3_moe quantized at load, their
  # decode and prefill through the MXFP4 kernels (biases and clamped SwiGLU included)
  run mxfp4_engine_tests python3 -m pytest -q $T --tb=short tests/engine/test_mxfp4_experts.py \
    tests/engine/test_gpt_oss.py -k mxfp4
  run mxfp4_kernels python3 -m moelab.kernels.bench \
    --only fused_moe,fused_moe_mxfp4,fused_moe_mxfp4_gpt_oss,grouped_moe,grouped_moe_mxfp4
  # NVFP4 (ModelOpt's releases) through the same kernels: e4m3 scales per 16, per-tensor scales
  run nvfp4_kernels python3 -m moelab.kernels.bench --only fused_moe_nvfp4,grouped_moe_nvfp4
  # one token through each decode launch and tile of both 4-bit formats, to pick the default's
  run fp4_decode_sweep python3 -m moelab.kernels.bench --sweep \
    --only fused_moe_mxfp4,fused_moe_mxfp4_gpt_oss,fused_moe_nvfp4
  run mxfp4_cpu_experts python3 -m moelab.kernels.cpu_experts_bench --threads 15 \
    --dtype bf16,mxfp4 --hidden 2880 --intermediate 2880 --num-experts 32 --experts 4
  # NVFP4 checkpoints (ModelOpt's layout) on the GPU: their experts kept 4-bit in the bank and
  # the slots, decode and prefill through nvfp4_moe, against transformers, and the decode
  # planner's copies of NVFP4 experts into CUDA slots; then the CPU kernel's NVFP4 path at
  # Qwen3.6-35B-A3B's expert shape
  run nvfp4_engine_tests env MOELAB_TEST_DEVICE=cuda python3 -m pytest -q $T --tb=short \
    tests/engine/test_nvfp4.py
  run nvfp4_planner_tests_cuda python3 -m pytest -q $T --tb=short tests/engine/test_planner.py \
    -k "on_cuda and nvfp4"
  run nvfp4_cpu_experts python3 -m moelab.kernels.cpu_experts_bench --threads 15 \
    --dtype bf16,nvfp4 --hidden 2048 --intermediate 512 --num-experts 64 --experts 8
fi
if [ "$part" = cpu_formats ]; then  # the native CPU kernel over each expert format against the
  # host's read rate (issues 52 and 54: >= 70% of it in each format's own bytes), 15 workers, at
  # Qwen3-30B-A3B's expert shape and gpt-oss's; no GPU work, so it runs beside nothing else
  F="--threads 15 --experts 1,2,4 --min-seconds 0.6"
  run cpu_formats_qwen3 python3 -m moelab.kernels.cpu_experts_bench $F --num-experts 128 \
    --dtype bf16,fp8,mxfp4,nvfp4
  run cpu_formats_gpt_oss python3 -m moelab.kernels.cpu_experts_bench $F --hidden 2880 \
    --intermediate 2880 --num-experts 32 --dtype bf16,fp8,mxfp4
  # the same formats with x of fp32 values: the fp32 path, beside the bf16 dot products above
  run cpu_formats_qwen3_fp32_x python3 -m moelab.kernels.cpu_experts_bench $F --num-experts 128 \
    --dtype fp8,mxfp4,nvfp4 --x fp32
  # the AVX2 path on the same host (what a CPU without AVX-512 runs: the fp16 widening of e2m1)
  run cpu_formats_qwen3_avx2 python3 -m moelab.kernels.cpu_experts_bench $F --num-experts 128 \
    --dtype bf16,fp8,mxfp4,nvfp4 --simd avx2
fi
if [ "$part" = fp8kv ]; then  # the FP8 KV cache: its kernels' tests natively and at real shapes,
  # the engine's long-prompt test on CUDA (it prints the logits' difference), decode attention
  # over bf16 and FP8 pages, decode at 8K and 32K tokens of context with each cache (then the
  # fp8kv_context part)
  T='-o addopts=-ra --import-mode=append -p no:cacheprovider'
  run fp8kv_tests python3 -m pytest -q $T --tb=short tests/kernels/test_fp8_kv.py \
    tests/kernels/test_rope_kv.py tests/kernels/test_paged_attention.py
  run fp8kv_engine_tests env MOELAB_TEST_DEVICE=cuda python3 -m pytest -q -s $T --tb=short \
    tests/engine/test_fp8_kv.py
  run fp8kv_kernels python3 -m moelab.kernels.bench \
    --only paged_attention,paged_attention_fp8,rope_kv,rope_kv_fp8
  for kv in auto fp8; do
    for ctx in 8192 32768; do
      run fp8kv_decode12_ctx${ctx}_$kv $B decode $G --routing-skew 1 --prompt-tokens $ctx \
        --kv-reserve-tokens $((ctx + 1024)) --kv-cache-dtype $kv --json
    done
  done
fi
if [ "$part" = fp8kv ] || [ "$part" = fp8kv_context ]; then  # the context a 24 GiB budget gives
  # all 48 layers with each KV cache when the model's whole context is reserved (the default
  # reserve gives both about 8K and the rest to the experts): kv_tokens, max_context and slots
  # in the JSON, proven by a prompt 64 tokens short of it, in one process each (after a
  # warm-up of 4,096 tokens)
  for kv in auto fp8; do
    run fp8kv_prompt48_$kv $B prefill --preset qwen3-30b-a3b --routing-skew 1 \
      --device-memory 24GiB --kv-cache-dtype $kv --kv-reserve-tokens 40960 \
      --prompt-tokens context-64 --repeats 1 --warmup-tokens 4096 --json
    context_share fp8kv_prompt48_$kv "$kv KV"
  done
fi
if [ "$part" = fp8engine ]; then  # FP8 experts in the engine: the FP8 checkpoint tests and the
  # decode planner's (bf16 and FP8 banks) on CUDA, then issue 52's rows, one process each, bf16
  # beside FP8 with the same device-memory budget
  T='-o addopts=-ra --import-mode=append -p no:cacheprovider'
  run fp8_engine_tests_cuda env MOELAB_TEST_DEVICE=cuda python3 -m pytest -q $T --tb=short \
    tests/engine/test_fp8.py tests/engine/test_planner.py
  M="--device-memory 24GiB --json"
  for dtype in bf16 fp8; do
    for skew in 1 0; do
      run fp8engine_decode12_24g_skew${skew}_$dtype $B decode $G --routing-skew $skew $M \
        --moe-expert-dtype $dtype --tokens 256 --repeats 3
    done
    run fp8engine_decode12_resident_$dtype $B decode $G --routing-skew 1 --json \
      --moe-expert-dtype $dtype
    for n in 512 8192; do  # the KV reserve past the default's 8,192 tokens of context
      run fp8engine_prefill12_cache25_${n}_$dtype $B prefill $G --prompt-tokens $n \
        --kv-reserve-tokens 9216 --moe-cache-rate 0.25 --json --moe-expert-dtype $dtype
    done
  done
fi
if [ "$part" = fp8engine ] || [ "$part" = fp8engine48 ]; then  # all 48 layers on the 24 GiB
  # budget, bf16 beside FP8 at skew 1 and 0, one process each
  for skew in 1 0; do
    for dtype in bf16 fp8; do
      run fp8engine_decode48_24g_skew${skew}_$dtype $B decode --preset qwen3-30b-a3b \
        --routing-skew $skew --device-memory 24GiB --json --moe-expert-dtype $dtype \
        --tokens 128 --repeats 2
    done
  done
fi
if [ "$part" = resident_timeline ]; then  # where the resident FP8 step's time goes (issue 52's
  # 1.3x): 12 layers all resident, bf16, FP8 experts, then FP8 experts and projections, each under
  # --kernel-profile --trace and broken down kernel by kernel (decode_timeline.py --steps)
  for case in "bf16 auto" "fp8 auto" "fp8 fp8"; do
    set -- $case
    name=resident_timeline_$1_$2
    run $name $B decode $G --routing-skew 1 --json --tokens 128 --moe-expert-dtype $1 \
      --dense-dtype $2 --kernel-profile --trace "$out/$name.json"
    run ${name}_steps python3 scripts/decode_timeline.py --steps "$out/$name.json"
    head -25 "$out/${name}_steps.log"
    gzip -f "$out/$name.json"
  done
fi
hybrid_part() { [ "$part" = hybrid ] || [ "$part" = "hybrid_$1" ]; }
if hybrid_part tests; then  # the Gated DeltaNet on CUDA: the kernels against the torch reference
  # at the real geometry (fla's rule, the rule's in-place decode kernel against the reference and
  # fla's adapter and in a graph, the convolution's kernels, a decode step in a graph), their
  # compile for sm_90, the engine against transformers; then the kernels' rows
  T='-o addopts=-ra --import-mode=append -p no:cacheprovider'
  run hybrid_kernel_tests python3 -m pytest -q $T --tb=short tests/kernels/test_gated_deltanet.py \
    tests/kernels/test_hopper_compile.py
  run hybrid_engine_tests env MOELAB_TEST_DEVICE=cuda python3 -m pytest -q $T --tb=short \
    tests/engine/test_hybrid.py
  run hybrid_kernels python3 -m moelab.kernels.bench --only short_conv,delta_rule
fi
# issue 53's speed rows: all 40 layers with dummy weights on a 24 GiB budget, one process each
H="${HYBRID:---preset qwen3.6-35b-a3b} --routing-skew 1 --device-memory 24GiB --json"
for dtype in ${DTYPES:-bf16 fp8}; do
  E="$H --moe-expert-dtype $dtype"
  if hybrid_part decode; then  # batch 1 (against t_min, the states' reads counted), and 8 at once
    run hybrid_decode_b1_$dtype $B decode $E --tokens 256 --repeats 3
    run hybrid_decode_b8_$dtype $B decode $E --batch 8 --tokens 128
  fi
  if hybrid_part context; then  # decode after a 32K and a 128K prompt (CONTEXTS picks: with
    # bf16 experts the two take longer than one call's 10 minutes)
    for ctx in ${CONTEXTS:-32768 131072}; do
      run hybrid_decode_ctx${ctx}_$dtype $B decode $E --prompt-tokens $ctx \
        --kv-reserve-tokens $((ctx + 1024)) --tokens 64 --warmup 8
    done
  fi
  if hybrid_part prefill; then  # prompts of 8K and 128K tokens (experts streamed as they are read)
    run hybrid_prefill_8192_$dtype $B prefill $E --prompt-tokens 8192 --repeats 3
    run hybrid_prefill_131072_$dtype $B prefill $E --prompt-tokens 131072 --repeats 1 \
      --kv-reserve-tokens 132096
  fi
  if hybrid_part 262k; then  # the whole native context: 262,144 tokens of FP8 KV reserved on the
    # 24 GiB budget, a prompt 72 tokens short of the context the engine then advertises
    # (max_context in the JSON; the model's own 262,144 caps it), and decode after it: the proof
    # and the row beside the published decode after a near-262K prompt, in one process
    M="$E --kv-cache-dtype fp8 --kv-reserve-tokens 262144"
    run hybrid_decode262k_$dtype $B decode $M --prompt-tokens context-72 --tokens 64 --warmup 8
    context_share hybrid_decode262k_$dtype 262K
  fi
  if hybrid_part turns; then  # a chat's second turn after a 32K first one: its time to first
    # token from the first turn's state checkpoint, and prefilled whole (--no-prefix-cache)
    run hybrid_second_turn_$dtype python3 scripts/prefix_cache_ttft.py --arch qwen3_5_moe \
      ${HYBRID:---preset qwen3.6-35b-a3b} --system 32768 --question 128 --reply 32 --turns 2 \
      --device-memory 24GiB --kv-reserve-tokens 40960 --moe-expert-dtype $dtype \
      --log-level warning
  fi
done
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
if [ "$part" = agent ]; then  # a coding agent's session through the Messages API (`moelab bench
  # agent`: a 12k-token system prompt with tools, 20 turns of 0.5-4k-token results and 50-300-token
  # replies: about 62k tokens in all), the 12 layers' geometry with dummy weights behind the
  # synthetic tokenizer and a context of 128k, with a 25% expert cache and all resident
  python3 -m moelab.engine.cli synth --out "$out/agent_model" --preset qwen3-30b-a3b \
    --set num_hidden_layers=12 --set max_position_embeddings=131072 --routing-skew 1 \
    --no-weights > /dev/null
  for rate in 0.25 1.0; do
    run agent_session_$rate $B agent --json -- --model-path "$out/agent_model" --dummy-weights \
      --device cuda --moe-cache-rate $rate --kv-reserve-tokens 98304 --log-level warning
  done
fi
if [ "$part" = resident ]; then  # all experts resident: overlapped decode against waiting steps
  run decode12_resident_skew1 $B decode $G --routing-skew 1 --json
  run decode12_resident_skew1_sync $B decode $G --routing-skew 1 --json --no-overlap-decode
  run decode12_resident_b8 $B decode $G --routing-skew 1 --batch 8 --json
  run decode12_resident_profile $B decode $G --routing-skew 1 --json --kernel-profile
  run decode12_cache25_skew1 $B decode $G --routing-skew 1 --moe-cache-rate 0.25 --json
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
if [ "$part" = timeline ]; then  # where an offloaded layer step's time goes with FP8 experts (the
  # fixed cost that keeps issues 52 and 53 under 75% of t_min): each kind of step's period, its
  # kernels' busy time and the host's part (decode_timeline.py), 48 of Qwen3-30B-A3B's layers on
  # 24 GiB, then Qwen3.6-35B-A3B's 40 on 24 GiB
  for model in "qwen3-30b-a3b 48" "qwen3.6-35b-a3b 40"; do
    set -- $model
    run timeline_$2 $B decode --preset $1 --routing-skew 1 --device-memory 24GiB \
      --moe-expert-dtype fp8 --json --tokens 64 --kernel-profile --trace "$out/trace$2.json"
    run timeline_$2_steps python3 scripts/decode_timeline.py "$out/trace$2.json"
    cat "$out/timeline_$2_steps.log"
    gzip -f "$out/trace$2.json"
  done
fi
if [ "$part" = early ]; then  # the cached routes at the routing (--moe-early-cached): its CUDA
  # tests, then decode with it off and on, one process each: 12 layers with 25% cached (bf16), 48
  # on 24 GiB (FP8 experts); `early_hybrid` Qwen3.6-35B-A3B's 40 on 24 GiB (FP8)
  T='-o addopts=-ra --import-mode=append -p no:cacheprovider'
  run early_tests_cuda env MOELAB_TEST_DEVICE=cuda python3 -m pytest -q $T --tb=short \
    tests/engine/test_graphs.py tests/kernels/test_host_handoff.py \
    -k "offloaded_decode_replays or slot_map"
  for early in off on; do
    run early_${early}_12 $B decode $G --routing-skew 1 --moe-cache-rate 0.25 --json \
      --tokens 256 --repeats 3 --moe-early-cached $early
  done
  for early in off on; do
    run early_${early}_48 $B decode --preset qwen3-30b-a3b --routing-skew 1 \
      --device-memory 24GiB --moe-expert-dtype fp8 --json --tokens 128 --repeats 2 \
      --moe-early-cached $early
  done
fi
if [ "$part" = early_hybrid ]; then
  for early in off on; do
    run early_${early}_40 $B decode --preset qwen3.6-35b-a3b --routing-skew 1 \
      --device-memory 24GiB --moe-expert-dtype fp8 --json --tokens 128 --repeats 2 \
      --moe-early-cached $early
  done
fi
if [ "$part" = crossover ] || [ "$part" = all ]; then  # the bw profile first: the crossover joins it
  run bw_profile $B bw --json
  run prefill12_crossover $B prefill $G --moe-cache-rate 0.25 --crossover --json
fi
if [ "$part" = autotune ]; then  # trial overhead of the benchmark, small preset, standard's target
  run autotune_small python3 -m moelab.autotune --model-path /tmp/small --mode quick \
    --target-s 60 --objective decode --only no-overlap-decode --out "$out/autotune_small.json"
fi
if [ "$part" = compare ]; then  # the mode rows of docs/performance.md, an older tree against this one
  pkg=$(mktemp -d)
  mkdir -p "$pkg/moelab"
  for d in engine kernels profiles autotune; do ln -s "$(realpath "${BEFORE:?}/$d")" "$pkg/moelab/$d"; done
  # the older tree through PYTHONPATH, with this tree's editable install's finder taken away
  before() {
    PYTHONPATH="$pkg${PYTHONPATH:+:$PYTHONPATH}" python3 -c 'import runpy, sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.argv[0] = "moelab"
import moelab.engine; print("tree:", moelab.engine.__file__, flush=True)
runpy.run_module("moelab.engine.cli", run_name="__main__")' "$@"
  }
  after() { python3 -m moelab.engine.cli "$@"; }
  cases=${CASES:-resident_b1 resident_b8 cache25_skew0 cache25_skew1 prefill512}
  for i in $(seq "${ROUNDS:-2}"); do
    for case in $cases; do
      for tree in before after; do
        case $case in
          resident_b1) args=(decode $G --routing-skew 1 --json) ;;
          resident_b8) args=(decode $G --routing-skew 1 --batch 8 --json) ;;
          cache25_skew*) args=(decode $G --routing-skew "${case#cache25_skew}" \
            --moe-cache-rate 0.25 --tokens 256 --json) ;;
          prefill512) args=(prefill $G --prompt-tokens 512 --repeats 5 --json) ;;
          prefill512_skew1) args=(prefill $G --routing-skew 1 --prompt-tokens 512 --repeats 5 --json) ;;
          # FP8 experts and projections all resident (issue 52's 1.3x), and FP8 experts on
          # 24 GiB at 48 layers (the offloaded layer step's host path)
          resident_fp8_b1) args=(decode $G --routing-skew 1 --json --tokens 256 --repeats 3 \
            --moe-expert-dtype fp8 --dense-dtype fp8) ;;
          fp8_48_24g_skew1) args=(decode --preset qwen3-30b-a3b --routing-skew 1 \
            --device-memory 24GiB --moe-expert-dtype fp8 --json --tokens 128 --repeats 2) ;;
          # Qwen3.6-35B-A3B's 40 layers on 24 GiB with FP8 experts: layer steps that split a
          # miss and copy one ahead (issue 53's batch-1 row)
          hybrid_fp8_b1) args=(decode --preset qwen3.6-35b-a3b --routing-skew 1 \
            --device-memory 24GiB --moe-expert-dtype fp8 --json --tokens 128 --repeats 2) ;;
        esac
        run compare_${case}_${tree}_$i $tree bench "${args[@]}"
      done
    done
  done
fi
if [ "$part" = split ]; then  # issue 56 on a two-GPU machine: the split against one GPU in bf16
  # (tests), then 12 of Qwen3-30B-A3B's layers all resident, one card against two (a graph per
  # card, with and without overlapped decode, and eager), then its 48 layers with each card
  # limited to 12 GiB against one card of 12 GiB: decode at batch 1 and 8 (each card's pieces
  # and eager), batch 8 in one micro-batch and two, prefill of 8K
  T='-o addopts=-ra --import-mode=append -p no:cacheprovider'
  run split_tests python3 -m pytest -q $T --tb=short tests/engine/test_split_engine.py \
    tests/engine/test_split_graphs.py tests/engine/test_split_pipeline.py
  for b in 1 8; do
    run split_resident_one_b$b $B decode $G --routing-skew 1 --batch $b --json
    run split_resident_two_b$b $B decode $G --routing-skew 1 --devices cuda:0,cuda:1 --batch $b \
      --json
    run split_resident_two_sync_b$b $B decode $G --routing-skew 1 --devices cuda:0,cuda:1 \
      --batch $b --no-overlap-decode --json
    run split_resident_two_eager_b$b $B decode $G --routing-skew 1 --devices cuda:0,cuda:1 \
      --batch $b --no-cuda-graph --json
  done
  S="--preset qwen3-30b-a3b --routing-skew 1 --device-memory 12GiB"
  for b in 1 8; do
    run split_one_b$b $B decode $S --batch $b --json
    run split_one_eager_b$b $B decode $S --batch $b --no-cuda-graph --json
    run split_two_b$b $B decode $S --devices cuda:0,cuda:1 --batch $b --json
    run split_two_eager_b$b $B decode $S --devices cuda:0,cuda:1 --batch $b --no-cuda-graph \
      --json
  done
  # a decode step in micro-batches (--split-microbatches): batch 8 in one against two, resident
  # (each card's graphs per micro-batch, and eager) and 12 GiB offloaded (eager pipelines; each
  # card's pieces run whole, the same launches as one micro-batch)
  for m in 1 2; do
    run split_resident_two_b8_m$m $B decode $G --routing-skew 1 --devices cuda:0,cuda:1 \
      --batch 8 --split-microbatches $m --json
    run split_resident_two_eager_b8_m$m $B decode $G --routing-skew 1 --devices cuda:0,cuda:1 \
      --batch 8 --split-microbatches $m --no-cuda-graph --json
    run split_two_b8_m$m $B decode $S --devices cuda:0,cuda:1 --batch 8 --split-microbatches $m \
      --json
    run split_two_eager_b8_m$m $B decode $S --devices cuda:0,cuda:1 --batch 8 \
      --split-microbatches $m --no-cuda-graph --json
  done
  run split_one_prefill8k $B prefill $S --prompt-tokens 8192 --repeats 2
  run split_two_prefill8k $B prefill $S --devices cuda:0,cuda:1 --prompt-tokens 8192 --repeats 2
  # each card's own link and memory rate (rows by gpu_index), and cards of unequal budgets: the
  # default split gives the smaller fewer layers (its log line names the card that limits)
  run split_bench_bw python3 -m moelab.engine.cli bench bw --threads 1 --json
  run split_two_unequal_b1 $B decode --preset qwen3-30b-a3b --routing-skew 1 \
    --device-memory 12GiB,8GiB --devices cuda:0,cuda:1 --json
fi
if [ "$part" = gptoss_context ]; then  # issue 54's long-context rows alone: decode after 32K
  # tokens and prefill of 32K, at gpt-oss-120b's geometry on 12 GiB and gpt-oss-20b's on 8 GiB
  for size in 120b:12GiB 20b:8GiB; do
    O="--arch gpt_oss --preset gpt-oss-${size%%:*} --moe-expert-dtype mxfp4 --routing-skew 1"
    O="$O --device-memory ${size##*:} --json"
    run gptoss_decode${size%%:*}_ctx32k $B decode $O --prompt-tokens 32768 \
      --kv-reserve-tokens 33792 --tokens 64 --warmup 8
    run gptoss_prefill${size%%:*}_32k $B prefill $O --prompt-tokens 32768 --repeats 1 \
      --kv-reserve-tokens 33792 --warmup-tokens 4096
  done
  # gpt-oss-20b's 32K prefill ran at half its PCIe streaming estimate: its device kernels, the
  # prompt's attention among them (torch.profiler's table at the log's end)
  run gptoss_prefill20b_32k_kernels $B prefill --arch gpt_oss --preset gpt-oss-20b \
    --moe-expert-dtype mxfp4 --routing-skew 1 --device-memory 8GiB --prompt-tokens 32768 \
    --repeats 1 --kv-reserve-tokens 33792 --kernel-profile
fi
if [ "$part" = admission ]; then  # the cache's two admissions alternated in one process (A B B
  # A, recent then frequency): gpt-oss-120b on 12 GiB at batch 8 and 1, then Qwen3-30B-A3B's 48
  # layers on 24 GiB
  A="--moe-cache-admission recent --alternate-cache-admission frequency"
  O="--arch gpt_oss --preset gpt-oss-120b --moe-expert-dtype mxfp4 --routing-skew 1"
  O="$O --device-memory 12GiB --json --repeats 4 $A"
  run admission_gptoss120b_b8 $B decode $O --batch 8 --tokens 128
  run admission_gptoss120b_b1 $B decode $O --tokens 128
  run admission_decode48_b1 $B decode --preset qwen3-30b-a3b --routing-skew 1 \
    --device-memory 24GiB --json --tokens 128 --repeats 4 $A
fi
if [ "$part" = gptoss ]; then  # gpt_oss: its kernels' tests natively (biased experts, sinks and
  # the window in decode attention), the engine against transformers on CUDA and the decode
  # planner's copies of MXFP4 and biased experts into CUDA slots, then issue 54's rows
  # with the experts kept MXFP4 (dummy weights made in MXFP4): gpt-oss-120b's geometry on a
  # 12 GiB budget and gpt-oss-20b's on 8 GiB, decode at batch 1 and 8, prefill of 2K and 32K
  T='-o addopts=-ra --import-mode=append -p no:cacheprovider'
  run gptoss_tests python3 -m pytest -q $T --tb=short tests/kernels/test_gpt_oss_experts.py \
    tests/kernels/test_paged_attention.py
  run gptoss_engine_tests_cuda env MOELAB_TEST_DEVICE=cuda python3 -m pytest -q $T --tb=short \
    tests/engine/test_gpt_oss.py
  run gptoss_planner_tests_cuda python3 -m pytest -q $T --tb=short tests/engine/test_planner.py \
    -k "on_cuda and (mxfp4 or bias)"
  for size in 20b:8GiB 120b:12GiB; do
    O="--arch gpt_oss --preset gpt-oss-${size%%:*} --moe-expert-dtype mxfp4 --routing-skew 1"
    O="$O --device-memory ${size##*:} --json"
    run gptoss_decode${size%%:*}_b1 $B decode $O --tokens 256 --repeats 3
    run gptoss_decode${size%%:*}_b8 $B decode $O --batch 8 --tokens 128
    run gptoss_decode${size%%:*}_ctx32k $B decode $O --prompt-tokens 32768 \
      --kv-reserve-tokens 33792 --tokens 64 --warmup 8
    run gptoss_prefill${size%%:*}_2k $B prefill $O --prompt-tokens 2048 --repeats 3
    run gptoss_prefill${size%%:*}_32k $B prefill $O --prompt-tokens 32768 --repeats 1 \
      --kv-reserve-tokens 33792
  done
fi
