#!/usr/bin/env bash
# The KV handover with and without the commit doorbell (pdserve/transport/doorbell.py), one
# device call, from the checkout with .gpu-kit carried (docs/benchmarks.md, "the commit
# doorbell"):
#
#   run(carry=[".gpu-kit"], command="bash pdserve/bench/gpu_handover_ab.sh")
#
# `pdserve bench transfer` over cuda_ipc (1k / 4k / 16k tokens of the 1B shape, one 1 GiB
# write per push) with the decode worker's stamps on (PDSERVE_HANDOVER_TRACE=1), ROUNDS times
# (default 2): with BUSY (default 4) other requests decoding, the doorbell on, then off
# (PDSERVE_KV_DOORBELL); then once idle with it on. Each run's report and decode worker log in
# <busy|idle>_<on|off>_<round>/ of $OUT/runs.tgz. GPU_TESTS, when set, runs those test files
# first. AB=argmax instead alternates the decode graphs' argmax graphs on and off
# (PDSERVE_ARGMAX_GRAPH_MAX_BATCH=0), the doorbell on in both; AB=stream_interval the decode
# worker's --stream-interval INTERVAL (default 4; busy_on_*) and 1 (busy_off_*); the decode step
# printed is read from the pushed request's stream, whose tokens then come INTERVAL at a time
# (0.00 there: read the step from the interval-1 runs); AB=engine_core the decode worker's
# engine in a process of its own (busy_on_*: --engine-core process) and in a thread (busy_off_*),
# the doorbell on in both.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench_results/gpu_handover}
ROUNDS=${ROUNDS:-2}
BUSY=${BUSY:-4}
mkdir -p "$OUT"
status=0
if [ -n "${GPU_TESTS:-}" ]; then
    ( source pdserve/bench/gpu_kit_env.sh && export PDSERVE_TEST_TOKENIZER="$PWD/$KIT/tokenizer" \
      && python3 -m pytest -q -p no:cacheprovider $GPU_TESTS ) 2>&1 | tee "$OUT/gpu_tests.log" \
        | tail -20
    status=${PIPESTATUS[0]}
fi
AB=${AB:-doorbell}
run() {  # run NAME DOORBELL BUSY_REQUESTS [ARGMAX_GRAPH_MAX_BATCH [STREAM_INTERVAL [ENGINE_CORE]]]
    mkdir -p "$OUT/$1"
    PDSERVE_ENGINE_CORE=${6:-thread} PDSERVE_STREAM_INTERVAL=${5:-1} PDSERVE_ARGMAX_GRAPH_MAX_BATCH=${4:-16} PDSERVE_KV_DOORBELL=$2 PDSERVE_HANDOVER_TRACE=1 COPY=0 TESTS=0 TRANSPORTS=cuda_ipc \
        OUT="$OUT/$1" bash pdserve/bench/gpu_kv_run.sh --slab-mib 8 --plane-slab-mib 1024 \
        --repeats 5 --kv-tokens 1024,4096,16384 --busy "$3" \
        --output-json "$OUT/$1/transfer.json" > "$OUT/$1/run.log" 2>&1
    python3 - "$OUT/$1/transfer.json" "$1" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
for case in report["pdserve"]:
    print(f"{sys.argv[2]:>12} {case['num_tokens']:>6} tokens: to the batch "
          f"{1e3 * (case.get('to_batch_s') or float('nan')):.2f} ms, decode step "
          f"{1e3 * case['decode_step_s']:.2f} ms, push {1e3 * case['push']['median_s']:.2f} ms, "
          f"commit to reply {1e3 * case['commit_to_reply_s']:.2f} ms")
PY
}
for round in $(seq 1 "$ROUNDS"); do
    if [ "$AB" = stream_interval ]; then
        run "busy_on_$round" on "$BUSY" 16 "${INTERVAL:-4}"
        run "busy_off_$round" on "$BUSY" 16 1
    elif [ "$AB" = engine_core ]; then
        run "busy_on_$round" on "$BUSY" 16 1 process
        run "busy_off_$round" on "$BUSY" 16 1 thread
    elif [ "$AB" = argmax ]; then
        run "busy_on_$round" on "$BUSY" 16
        run "busy_off_$round" on "$BUSY" 0
    else
        run "busy_on_$round" on "$BUSY"
        run "busy_off_$round" off "$BUSY"
    fi
done
run idle_on_1 on 0
# one archive: the device tool brings back a few files per call
(cd "$OUT" && tar czf runs.tgz busy_* idle_* && rm -rf busy_* idle_*)
exit $status
