#!/usr/bin/env bash
# The quantized decode kernels on a lent GPU, one device call per part, from the checkout with
# .gpu-kit carried (docs/benchmarks.md, "Quantized weights end to end"):
#
#   run(carry=[".gpu-kit"], command="bash pdserve/bench/gpu_quant_run.sh kernels")
#
# Parts (any of them, in order; default "tests kernels latency"):
#   tests     the quantized kernels' test files on the GPU (GPU_TESTS to change the list)
#   kernels   pdserve.bench.gpu_w4a16 at TOKENS (default 1): each projection's W4A16 GEMV tiles
#   latency   pdserve.bench.gpu_quant --no-w1: batch-1 ms per token for SYSTEMS
#             (default bf16,fp8,w4a16), each against its weights-read floor
#   profile   pdserve.bench.gpu_decode_profile for SYSTEMS: the kernels inside the decode graph
#             and the GEMV plan's timings
#   w1        pdserve.bench.gpu_quant's W1 offline throughput, W1_RUNS (default 3) per system
#   prologue  the W4A16 GEMV's prologue tests on the GPU, then batch-1 w4a16 against
#             w4a16_fused (the norms and SwiGLU in the GEMV), twice, the order swapped, and
#             the two decode graphs' kernels
#   pairs     the W4A16 GEMV's tests on the GPU (PAIR_TESTS: a -k expression), its tiles with
#             the fp32 loop and with codes in fp16 pairs (weights from DRAM), batch-1 of
#             PAIR_SYSTEMS (default w4a16,w4a16_fp32) twice, the order reversed, then
#             PAIR_EXTRA (default w4a16_fused), and the decode graphs' kernels of PAIR_SYSTEMS
#             (the codes by TMA: PAIR_TESTS='tma or pairs' PAIR_SYSTEMS=w4a16,w4a16_tma)
#   argmax    the decode graphs' tests on the GPU, then batch-1 of each of ARGMAX_ORDERS (system
#             lists, each in a process of its own; default w4a16 against w4a16_hostargmax three
#             times, the order alternated, then bf16 against bf16_hostargmax), then
#             pdserve.bench.gpu_first_step's phases with the argmax graphs and without
#   trace     pdserve.bench.gpu_throughput_trace of W1 for each of TRACE_ORDER (default bf16 fp8
#             bf16 fp8, each in a process of its own, TRACE_RUNS runs, default 3): the decode
#             steps' host phases and waits for the device; the last process of each system
#             also profiles its last run's decode steps with torch.profiler (GPU busy time;
#             TRACE_PROFILE=0: none). An entry SYSTEM:N runs with the argmax graphs up to
#             batch N (PDSERVE_ARGMAX_GRAPH_MAX_BATCH; default 16)
#   fp8rows   the FP8 GEMM's and the fused activation quantization's tests on the GPU, the
#             FP8 GEMMs at ROWS_TOKENS (default 256: torch._scaled_mm against
#             kernels/fp8_gemm.py's tiles) and the Triton FP8 GEMM's error launch by launch
#             (pdserve.bench.fp8_gemm_error: fp8_gemm_error.json), then W1 and batch 1 of
#             ROWS_SYSTEMS (default bf16, fp8 and fp8_unfused: each projection quantizing its
#             own activations; fp8_triton: the rows' products by kernels/fp8_gemm.py),
#             W1_RUNS each (default 3)
#   rope      the fused norm + q/k/v + rotary + KV store GEMV's tests on the GPU and the CUDA
#             path's, then batch-1 of ROPE_SYSTEMS (default fp8,bf16) with it and without
#             (PDSERVE_FUSED_QKV_ROPE=1 / 0, each in a process of its own, in the order of
#             ROPE_ORDER, default 1 0 1), then pdserve.bench.gpu_decode_profile of ROPE_SYSTEMS
#             both ways with --timeline 64 (the graph's kernels, a token's GPU timeline)
#   pdl       the attention kernels' tests on the GPU, then as `rope` for the decode attention
#             launched by PDL or not (PDSERVE_ATTN_PDL=1 / 0, in the order of PDL_ORDER), with
#             the decode graphs' tests (their inputs staged by one kernel)
#   stage     as `rope` for the graphs' inputs staged by one kernel or copied one by one
#             (PDSERVE_STAGE_KERNEL=1 / 0, in the order of STAGE_ORDER)
# Reports in $OUT; a fresh PDSERVE_CACHE_DIR, so every GEMV plan is timed, none recorded.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench_results/gpu_quant}
SYSTEMS=${SYSTEMS:-bf16,fp8,w4a16}
GPU_TESTS=${GPU_TESTS:-tests/test_kernel_widen.py tests/test_kernel_gemv.py tests/test_kernel_gemv_fp8.py \
tests/test_quant_fp8.py tests/test_quant_w4a16.py tests/test_kernel_w4a16_gemv_inputs.py}
mkdir -p "$OUT"
source pdserve/bench/gpu_kit_env.sh || exit 1
export PDSERVE_CACHE_DIR
PDSERVE_CACHE_DIR=$(mktemp -d)
status=0
# ab_batch1 VAR "V1 V2 ..." NAME TAG: batch-1 of ROPE_SYSTEMS (default fp8,bf16) with VAR set to
# each value in turn, a process each, then the decode profile (--timeline 64) with the first
# two values; reports in $OUT/NAME_<i>_TAG<value>, $OUT/profile_TAG<value>
ab_batch1() {
  local var=$1 values=$2 name=$3 tag=$4 i=0 value model
  model=$(mktemp -d)/model
  for value in $values; do
    i=$((i + 1))
    env "$var=$value" python3 -m pdserve.bench.gpu_quant --out "$OUT/${name}_${i}_$tag$value" \
        --systems "${ROPE_SYSTEMS:-fp8,bf16}" --no-w1 --model-dir "$model" 2>&1 \
        | grep "batch-1" || status=1
  done
  for value in $(echo "$values" | tr ' ' '\n' | awk '!seen[$0]++' | head -2); do
    env "$var=$value" python3 -m pdserve.bench.gpu_decode_profile \
        --systems "${ROPE_SYSTEMS:-fp8,bf16}" --timeline 64 --model-dir "$model" \
        --out "$OUT/profile_$tag$value" 2>&1 | grep -v " INFO " | tail -40 || status=1
  done
}
for part in "${@:-tests kernels latency}"; do
  for p in $part; do
    echo "== $p"
    case $p in
      tests) python3 -m pytest -q -p no:cacheprovider $GPU_TESTS 2>&1 | tail -15
             status=$((status | PIPESTATUS[0])) ;;
      kernels) python3 -m pdserve.bench.gpu_w4a16 --out "$OUT" --tokens "${TOKENS:-1}" \
               || status=1 ;;
      latency) python3 -m pdserve.bench.gpu_quant --out "$OUT" --systems "$SYSTEMS" --no-w1 \
               || status=1 ;;
      profile) python3 -m pdserve.bench.gpu_decode_profile --systems "$SYSTEMS" --out "$OUT" \
               || status=1 ;;
      rope)
        python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gemv_rope.py \
            tests/test_cuda_path.py 2>&1 | tail -3
        status=$((status | PIPESTATUS[0]))
        ab_batch1 PDSERVE_FUSED_QKV_ROPE "${ROPE_ORDER:-1 0 1}" rope fused ;;
      pdl)
        python3 -m pytest -q -p no:cacheprovider tests/test_kernels_attention.py \
            tests/test_triton_backend.py tests/test_cuda_path.py tests/test_stage_inputs.py \
            tests/test_argmax_graphs.py tests/test_spec_graphs.py 2>&1 | tail -3
        status=$((status | PIPESTATUS[0]))
        ab_batch1 PDSERVE_ATTN_PDL "${PDL_ORDER:-1 0 1}" pdl pdl ;;
      stage) ab_batch1 PDSERVE_STAGE_KERNEL "${STAGE_ORDER:-1 0 1}" stage stage ;;
      w1) python3 -m pdserve.bench.gpu_quant --out "$OUT" --systems "$SYSTEMS" \
          --w1-runs "${W1_RUNS:-3}" || status=1 ;;
      prologue)
        python3 -m pytest -q -p no:cacheprovider tests/test_kernel_w4a16_gemv_inputs.py \
            tests/test_quant_w4a16.py -k "gpu or hooks or hopper or prologue" 2>&1 | tail -3
        status=$((status | PIPESTATUS[0]))
        for order in w4a16,w4a16_fused w4a16_fused,w4a16; do
          python3 -m pdserve.bench.gpu_quant --out "$OUT/$order" --systems $order --no-w1 \
              2>&1 | grep "batch-1" || status=1
        done
        python3 -m pdserve.bench.gpu_decode_profile --systems w4a16,w4a16_fused --out "$OUT" \
            2>&1 | grep -A9 "batch-1 step" || status=1 ;;
      pairs)
        python3 -m pytest -q -p no:cacheprovider tests/test_quant_w4a16.py \
            tests/test_kernel_w4a16_gemv_inputs.py \
            -k "${PAIR_TESTS:-gemv or pairs or gpu or hooks or hopper}" 2>&1 | tail -3
        status=$((status | PIPESTATUS[0]))
        python3 -m pdserve.bench.gpu_w4a16 --out "$OUT" --tokens 1 --gemv-only \
            --gemv-tiles "${PAIR_TILES:-16x16x1,32x32x2,64x64x4,64x64x8,128x32x4}" 2>&1 \
            | grep "M=1" || status=1
        model=$(mktemp -d)/model
        systems=${PAIR_SYSTEMS:-w4a16,w4a16_fp32}
        reversed=$(echo "$systems" | tr , '\n' | tac | paste -sd,)
        for order in "$systems" "$reversed" ${PAIR_EXTRA-w4a16_fused}; do
          python3 -m pdserve.bench.gpu_quant --out "$OUT/${order//,/-}" --systems "$order" \
              --no-w1 --model-dir "$model" 2>&1 | grep "batch-1" || status=1
        done
        python3 -m pdserve.bench.gpu_decode_profile --systems "$systems" --out "$OUT" \
            --model-dir "$model" 2>&1 | grep -A9 "batch-1 step\|^w4a16" || status=1 ;;
      argmax)
        python3 -m pytest -q -p no:cacheprovider tests/test_argmax_graphs.py \
            tests/test_cuda_path.py tests/test_spec_graphs.py 2>&1 | tail -3
        status=$((status | PIPESTATUS[0]))
        model=$(mktemp -d)/model
        i=0
        for order in ${ARGMAX_ORDERS:-w4a16,w4a16_hostargmax w4a16_hostargmax,w4a16 \
            w4a16,w4a16_hostargmax bf16,bf16_hostargmax}; do
          i=$((i + 1))
          python3 -m pdserve.bench.gpu_quant --out "$OUT/argmax_$i" --systems "$order" \
              --no-w1 --model-dir "$model" 2>&1 | grep "batch-1" || status=1
        done
        for flag in "" --host-argmax; do
          python3 -m pdserve.bench.gpu_first_step --requests 6 --out "$OUT/first_step$flag" \
              $flag 2>&1 | grep "step" || status=1
        done ;;
      trace)
        model=$(mktemp -d)/model
        i=0
        order=(${TRACE_ORDER:-bf16 fp8 bf16 fp8})
        for entry in "${order[@]}"; do
          i=$((i + 1))
          system=${entry%%:*}  # SYSTEM:N runs with PDSERVE_ARGMAX_GRAPH_MAX_BATCH=N
          most=16; [ "$entry" = "$system" ] || most=${entry#*:}
          name=$system; [ "$entry" = "$system" ] || name=${system}_argmax$most
          args=(--runs "${TRACE_RUNS:-3}" --model-dir "$model" --json "$OUT/trace_${i}_$name.json")
          [ "$system" = bf16 ] || args+=(--quantization "$system")
          later=$(printf '%s\n' "${order[@]:$i}" | grep -cx "$entry")
          [ "$later" = 0 ] && [ "${TRACE_PROFILE:-1}" = 1 ] \
              && args+=(--torch-profile "$OUT/profile_$name")
          echo "-- $i: $name"
          PDSERVE_ARGMAX_GRAPH_MAX_BATCH=$most python3 -m pdserve.bench.gpu_throughput_trace \
              "${args[@]}" 2>&1 | grep -v "slow step" | tail -12
          status=$((status | PIPESTATUS[0]))
        done ;;
      fp8rows)
        python3 -m pytest -q -p no:cacheprovider --tb=line tests/test_kernel_fp8_gemm.py \
            tests/test_kernels_fp8_fused.py tests/test_quant_fp8.py 2>&1 | tail -12
        status=$((status | PIPESTATUS[0]))
        python3 -m pdserve.bench.fp8_gemm_error --output-json "$OUT/fp8_gemm_error.json" \
            > "$OUT/fp8_gemm_error.txt" 2>&1 || status=1
        python3 -m pdserve.bench.gpu_quant_gemm --out "$OUT" --tokens "${ROWS_TOKENS:-256}" \
            2>&1 | grep -v "^ *$" | tail -12 || status=1
        python3 -m pdserve.bench.gpu_quant --out "$OUT/rows" --systems "${ROWS_SYSTEMS:-bf16,fp8,fp8_unfused}" \
            --w1-runs "${W1_RUNS:-3}" 2>&1 | grep -E "W1|batch-1" || status=1 ;;
      *) echo "unknown part $p"; status=1 ;;
    esac
  done
done
exit $status
