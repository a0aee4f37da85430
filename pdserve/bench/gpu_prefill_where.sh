#!/usr/bin/env bash
# Where a split cluster's prefill worker spends a burst, in one device call (docs/loadtest.md):
#
#   run(carry=[".gpu-kit"], command="bash pdserve/bench/gpu_prefill_where.sh")
#
# 1. the one-GPU load test, colocated against the split over cuda_ipc (four gateways, 96
#    requests at 16 req/s and twice as a burst), every engine process's step timeline
#    (PDSERVE_STEP_TIMELINE) and every process's stack samples and thread CPU during the
#    bursts only (PDSERVE_STACK_SAMPLES, gated);
# 2. prefill_burst over cuda_ipc: the prefill worker's host time a prompt when the model costs
#    nothing (hidden 64), its threads' CPU and stacks during the bursts.
# Everything lands in $OUT: gpu_serve.json, prefill_burst.json and runs.tgz (the load tests'
# reports and logs, the timelines, the samples). Read them with
#   python -m pdserve.bench.step_gaps o/tl
#   python -m pdserve.bench.burst_timeline o/a/loadtest_cuda_ipc.json o/a/cluster_cuda_ipc.log
#   python -m pdserve.bench.pyspy_summary o/stacks/prefill-*.txt "_run_once"
set -uo pipefail
cd "$(dirname "$0")/../.."
R=${OUT:-bench_results/gpu_prefill_where}
W=/tmp/o
mkdir -p "$R" "$W/tl" "$W/stacks" "$W/pb_stacks"
(
    export PDSERVE_STEP_TIMELINE=$W/tl PDSERVE_STACK_SAMPLES=$W/stacks \
        PDSERVE_STACK_SAMPLE_WHILE=$W/gate PDSERVE_STACK_SAMPLE_HZ=${HZ:-400}
    OUT=$W/a timeout "${SERVE_S:-420}" bash pdserve/bench/gpu_kit_run.sh \
        --systems colocated,cuda_ipc --api-server-count 4 --colocated-api-servers 4 \
        --request-rate 16,inf,inf --sample-rates inf
) > "$W/serve.txt" 2>&1
tail -25 "$W/serve.txt"
cp "$W/a/gpu_serve.json" "$R/" 2>/dev/null
(
    export PYTHONPATH="${SITE:-/tmp/site}:$PWD" PDSERVE_STACK_SAMPLES=$W/pb_stacks \
        PDSERVE_STACK_SAMPLE_WHILE=$W/pb_gate PDSERVE_STACK_SAMPLE_HZ=${HZ:-400}
    timeout "${BURST_S:-150}" python3 -m pdserve.bench.prefill_burst --device cuda \
        --transport cuda_ipc --rounds 6 --prompts 96 --output-json "$R/prefill_burst.json"
) > "$W/burst.txt" 2>&1
tail -8 "$W/burst.txt"
for f in "$W"/pb_stacks/prefill-*.cpu.json "$W"/stacks/prefill-*.cpu.json; do
    echo "== $f"; head -12 "$f"
done
tar czf "$R/runs.tgz" -C /tmp o
