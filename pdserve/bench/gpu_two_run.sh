#!/usr/bin/env bash
# The two-GPU run (docs/benchmarks.md, "Two GPUs"): on a lent machine of two GPUs, from the
# checkout, with .gpu-kit carried (built here by pdserve/bench/gpu_kit.sh), one part per call:
#
#   run(kind="nvidia-h200-x2", carry=[".gpu-kit"],
#       command="bash pdserve/bench/gpu_two_run.sh prefill_heavy")    # then decode_heavy, tp
#
#   prefill_heavy, decode_heavy   does disaggregation pay? The 1B-shaped random model in bf16:
#       two colocated replicas (one per GPU, the load alternating between them) against one
#       prefill worker on GPU 0 and one decode worker on GPU 1, the KV over cuda_ipc and over
#       grpc; the mix's prompts and outputs (prefill_heavy: 1k-4k in, 64-256 out; decode_heavy:
#       128-512 in, 256-512 out) at three request rates up to saturation; SLOs TTFT <= 1 s and
#       TPOT <= 50 ms. The summary ($OUT/<mix>/gpu_serve.json and the table) gives goodput,
#       TTFT/TPOT/ITL p50/p99, output tok/s and the KV handover's share of the time to the
#       second token; the load generator's reports and the servers' logs stay on the machine.
#   tp  tensor parallelism on two GPUs: first NCCL inside CUDA graphs alone, in a TP engine's
#       step pattern (pdserve/bench/gpu_nccl_graph_probe.py steps; PROBE=0 skips it), then the
#       two-GPU tests (tests/test_tp_cuda.py: TP=2, eager and from CUDA graphs, equals TP=1;
#       prefill TP=2 -> decode TP=1 and back equal colocated; at most TP_TEST_S seconds, default
#       170, each test named as it ends; TESTS=0 skips them), then TP=2 against TP=1 and HF
#       generate_batch: `python -m pdserve.bench.gpu --parts tp` (at most TP_BENCH_S seconds,
#       default 330; add `--tp-shape 8b` for the 8B shape, `--tp-eager` for TP=2 without
#       graphs). A step still running 20 s before its bound leaves every Python process's
#       stacks in $OUT/stacks.txt (pdserve/bench/with_stacks.sh).
#   ep  expert parallelism's communication, all-to-all against replicated tokens + all-reduce
#       (`python -m pdserve.bench.ep_comm`), Mixtral-shaped: hidden 2048, 8 experts, top 2.
#   kv  one request's KV (the 1B shape, 1k/4k/16k tokens) from GPU 0 to a decode worker on
#       GPU 1 over cuda_ipc and grpc, against a peer-to-peer copy_ of the same bytes
#       (`pdserve.bench.transfer --decode-gpu 1`, through gpu_kv_run.sh without its tests).
#   kvcopy  the block-copy kernel alone between the GPUs, against a peer-to-peer copy_ of the
#       same bytes: pushed by GPU 0 into GPU 1's pool and pulled by GPU 1 from GPU 0's, for a
#       sweep of its settings (`python -m pdserve.bench.gpu_kv_copy --peer`; about 2 minutes;
#       $OUT/gpu_kv_copy_peer.json and .txt).
#
# Arguments after the part go on to the command (e.g. `--request-rate 2,6,inf`).
set -euo pipefail
cd "$(dirname "$0")/../.."
PART=${1:?usage: gpu_two_run.sh prefill_heavy|decode_heavy|tp|ep|kv|kvcopy [FLAGS]}
shift
KIT=${KIT:-.gpu-kit}
# shellcheck source=pdserve/bench/gpu_kit_env.sh
source pdserve/bench/gpu_kit_env.sh
export PYTHONPATH
OUT=${OUT:-bench_results/gpu_two}
case "$PART" in
    prefill_heavy) RATES=4,12,inf ;;
    decode_heavy) RATES=8,24,inf ;;
    tp) mkdir -p "$OUT"  # each step bounded; a step still running near its end: stacks.txt
        [ "${PROBE:-1}" = 1 ] && { bash pdserve/bench/with_stacks.sh 70 "$OUT/stacks.txt" \
            python3 pdserve/bench/gpu_nccl_graph_probe.py steps 2>&1 \
            | tee "$OUT/nccl_graph_probe.txt" | grep -E "RESULT|exitcodes" || true; }
        [ "${TESTS:-1}" = 1 ] && { bash pdserve/bench/with_stacks.sh "${TP_TEST_S:-170}" \
            "$OUT/stacks.txt" python3 -m pytest -v -p no:cacheprovider tests/test_tp_cuda.py \
            2>&1 | tee "$OUT/test_tp_cuda.txt" | tail -15 || true; }
        bash pdserve/bench/with_stacks.sh "${TP_BENCH_S:-330}" "$OUT/stacks.txt" \
            python3 -m pdserve.bench.gpu --parts tp --json "$OUT/gpu_tp.json" "$@" 2>&1 \
            | tee "$OUT/bench_tp.txt" | grep -v " INFO "
        exit ;;
    ep) exec python3 -m pdserve.bench.ep_comm --output-json "$OUT/ep_comm.json" "$@" ;;
    kv) OUT="$OUT/kv" TESTS=0 exec bash pdserve/bench/gpu_kv_run.sh --decode-gpu 1 \
            --slab-mib 8 --plane-slab-mib 256 --repeats 3 "$@" ;;
    kvcopy) mkdir -p "$OUT"
        python3 -m pdserve.bench.gpu_kv_copy --peer --out "$OUT" "$@" 2>&1 \
            | tee "$OUT/gpu_kv_copy_peer.txt"
        exit ;;
    *) echo "gpu_two_run.sh: unknown part $PART" >&2; exit 2 ;;
esac
exec python3 -m pdserve.bench.gpu_serve --systems replicas,split_cuda_ipc,split_grpc \
    --mix "$PART" --request-rate "$RATES" --num-prompts 32 --num-warmups 2 --max-duration 30 \
    --slo-ttft-ms 1000 --slo-tpot-ms 50 --redis-server "$KIT/redis-server" \
    --tokenizer "$KIT/tokenizer" --out-dir "$OUT/$PART" --work-dir "/tmp/gpu_two/$PART" "$@"
