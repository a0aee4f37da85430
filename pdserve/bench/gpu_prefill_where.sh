#!/usr/bin/env bash
# Where a split cluster's prefill worker spends a burst, and what its engine core process
# changes, in one device call (docs/loadtest.md):
#
#   run(carry=[".gpu-kit"], command="bash pdserve/bench/gpu_prefill_where.sh")
#
# PARTS (default "serve core"), each into $OUT (RATES: the load's rates, default 16,inf,inf):
#   tests  the repository's GPU test file of the two worker processes sharing the GPU
#          (tests/test_kv_cuda_ipc.py; GPU_TESTS to name others): gpu_tests.log
#   step   one prompt's prefill step alone (pdserve.bench.prefill_step, the 1B shape), eager
#          against replayed as decode rows in one engine: prefill_step.json
#   serve  the one-GPU load test, colocated against the split over cuda_ipc (four gateways, 96
#          requests at 16 req/s and twice as a burst; each worker's engine where `auto` puts it
#          on a GPU: in a process of its own) with every process's step timeline or
#          collections (PDSERVE_STEP_TIMELINE); with STACKS=1 also every process's stack
#          samples and thread CPU during the bursts only (PDSERVE_STACK_SAMPLES, gated; the
#          load generator then runs once per rate); with PROC_CPU=1 every process's CPU and
#          the machine's busy and stolen cores each 0.1 s (pdserve.bench.proc_cpu):
#          a_gpu_serve.json, cpu_a.json
#   abba   the serve part's comparison twice, colocated then split, then split then colocated
#          (what drifts during a call, such as a step's host time, weighs on both sides
#          alike), timelines too: abba_1_gpu_serve.json, abba_2_gpu_serve.json, and each
#          engine's steps by batch (step_gaps --brief: period, device wait, host, CPU):
#          abba_1_steps.txt, abba_2_steps.txt
#   pace   the split's decode worker pacing its steps beside the prefill worker (pdserve up
#          --shared-gpu-pace-ms P for each P of PACES, default "0 10 25"), between two
#          colocated runs, each with timelines and its steps by batch: pace_<P>_gpu_serve.json,
#          pace_<P>_steps.txt (the prefill engine core's too), the first rate's TTFT parts
#          printed (ttft_breakdown --brief), pace_colocated_<n>_gpu_serve.json (PACE_RUNS:
#          the whole list of runs instead, e.g. "colocated_1 0 20 4:1"; P:T paces from T
#          prompt tokens on their way, a bare P from PACE_TOKENS (default 0: never by
#          tokens); the decode worker also holds while the prefill worker marks a step in
#          flight, pdserve up's --shared-gpu-step-marks; files of P:T are named PtT)
#   streams the split's Prefill calls as messages on one shared call per gateway and prefill
#          worker (pdserve up --prefill-streams shared, the default) against a call each
#          (per-request), between colocated runs, each with timelines, its steps by batch and
#          the first rate's TTFT parts (STREAMS_RUNS: the runs, default "colocated_1 shared_1
#          per-request_1 shared_2 per-request_2 colocated_2"): streams_<run>_gpu_serve.json,
#          streams_<run>_steps.txt; pooled: gpu_serve_table streams_*_gpu_serve.json
#   parts  the split's first token, part by part: gRPC's own unary call between two processes
#          (pdserve.bench.grpc_ping, 1, 20 and 60 ms between calls), then colocated against
#          the split over cuda_ipc at RATES (default here 16,16) with timelines, and each
#          run's parts (pdserve.bench.ttft_breakdown): grpc_ping.txt, parts_gpu_serve.json,
#          parts_breakdown_<run>.json
#   core   the split again, its prefill engine in its worker's thread (pdserve up
#          --prefill-engine-core thread; CORES="thread process": each, in turn), timelines
#          too: b_thread_gpu_serve.json
#   burst  prefill_burst over cuda_ipc, the prefill engine in a thread and in a process: the
#          prefill worker's host time a prompt when the model costs nothing (hidden 64), its
#          threads' CPU and stacks during the bursts: burst_thread.json, burst_process.json
# ROWS=N exports PDSERVE_GRAPH_ROW_KEYS=N to every engine the parts start (the cap on
# prompts' chunks replayed as decode rows, engine/spec_graphs.py; 262144 the default, 0 off;
# the step part sets its own caps).
# More than 7 files of results go as results.tgz (a device call brings back at most 8 files).
# And runs.tgz (the load tests' reports and logs, the timelines, the samples). Read them with
#   python -m pdserve.bench.step_gaps o/tl_a
#   python -m pdserve.bench.burst_timeline o/a/loadtest_cuda_ipc.json o/a/cluster_cuda_ipc.log
#   python -m pdserve.bench.pyspy_summary o/stacks/prefill-*.txt "_run_once"
set -uo pipefail
cd "$(dirname "$0")/../.."
source pdserve/bench/gpu_kit_env.sh || exit 1  # the kit's wheels, for prefill_burst too
R=${OUT:-bench_results/gpu_prefill_where}
W=/tmp/o
PARTS=${PARTS:-serve core}
SERVE=(--api-server-count 4 --colocated-api-servers 4 --request-rate "${RATES:-16,inf,inf}")
mkdir -p "$R" "$W"
lscpu | grep -E "^(Model name|Thread\(s\) per core|Core\(s\) per socket|Socket\(s\)|CPU\(s\)):"
[ -n "${ROWS:-}" ] && export PDSERVE_GRAPH_ROW_KEYS=$ROWS
# timed_serve NAME LIMIT_S FLAGS...: one load run with every process's step timeline, its table
# rows printed, gpu_serve.json and its engines' steps by batch into $R as NAME_*, the first
# rate's TTFT parts printed (the pace and streams parts' runs)
timed_serve() {
    local name=$1 limit=$2
    shift 2
    mkdir -p "$W/tl_$name"
    PDSERVE_STEP_TIMELINE=$W/tl_$name OUT=$W/$name timeout "$limit" \
        bash pdserve/bench/gpu_kit_run.sh "$@" "${SERVE[@]}" > "$W/$name.txt" 2>&1
    grep -E "^\| (colocated|cuda_ipc) " "$W/$name.txt"
    cp "$W/$name/gpu_serve.json" "$R/${name}_gpu_serve.json"
    python3 -m pdserve.bench.step_gaps "$W/tl_$name" --brief \
        --buckets 1-8,90-1000 | grep -E "^(core|decode_svc-core|prefill_svc-core)" \
        | tee "$R/${name}_steps.txt"
    python3 -m pdserve.bench.ttft_breakdown "$W/$name"/loadtest_*.json \
        "$W/$name"/cluster_*.log --run 0 --brief
}
status=0
for part in $PARTS; do
    case $part in
    tests)
        timeout "${TESTS_S:-200}" python3 -m pytest -q -p no:cacheprovider \
            ${GPU_TESTS:-tests/test_kv_cuda_ipc.py} 2>&1 \
            | tee "$R/gpu_tests.log" | tail -15
        status=${PIPESTATUS[0]}
        ;;
    step)
        timeout "${STEP_S:-150}" python3 -m pdserve.bench.prefill_step --lengths 128,512,2048 \
            --repeats 5 --row-keys 0,262144 --output-json "$R/prefill_step.json" 2>&1 \
            | grep -E "tokens|rror"
        ;;
    serve)
        mkdir -p "$W/tl_a" "$W/stacks"
        sampling=()  # STACKS=1: stack samples and thread CPU during the bursts
        [ "${STACKS:-0}" = 1 ] && sampling=(--sample-rates inf)
        cpu=""
        if [ "${PROC_CPU:-0}" = 1 ]; then
            python3 -m pdserve.bench.proc_cpu --interval 0.1 --out "$R/cpu_a.json" --match \
                pdserve,engine_core,engine.core_process,loadtest,redis-server &
            cpu=$!
        fi
        (
            export PDSERVE_STEP_TIMELINE=$W/tl_a
            if [ "${STACKS:-0}" = 1 ]; then
                export PDSERVE_STACK_SAMPLES=$W/stacks PDSERVE_STACK_SAMPLE_WHILE=$W/gate \
                    PDSERVE_STACK_SAMPLE_HZ=${HZ:-400}
            fi
            OUT=$W/a timeout "${SERVE_S:-330}" bash pdserve/bench/gpu_kit_run.sh \
                --systems colocated,cuda_ipc "${SERVE[@]}" "${sampling[@]}"
        ) > "$W/serve_a.txt" 2>&1
        [ -n "$cpu" ] && kill -TERM "$cpu" && wait "$cpu"
        tail -12 "$W/serve_a.txt"
        cp "$W/a/gpu_serve.json" "$R/a_gpu_serve.json"
        ;;
    abba)
        n=0
        for order in colocated,cuda_ipc cuda_ipc,colocated; do
            n=$((n + 1))
            mkdir -p "$W/tl_abba_$n"
            PDSERVE_STEP_TIMELINE=$W/tl_abba_$n OUT=$W/abba_$n timeout "${SERVE_S:-330}" \
                bash pdserve/bench/gpu_kit_run.sh --systems "$order" "${SERVE[@]}" \
                > "$W/abba_$n.txt" 2>&1
            tail -10 "$W/abba_$n.txt"
            cp "$W/abba_$n/gpu_serve.json" "$R/abba_${n}_gpu_serve.json"
            python3 -m pdserve.bench.step_gaps "$W/tl_abba_$n" --brief \
                --buckets 1-8,40-60,90-1000 | tee "$R/abba_${n}_steps.txt"
        done
        ;;
    pace)
        for spec in ${PACE_RUNS:-colocated_1 ${PACES:-0 10 25} colocated_2}; do
            pace=${spec%%:*} tokens=${PACE_TOKENS:-0}
            [ "$pace" != "$spec" ] && tokens=${spec#*:}
            run=${spec/:/t}
            flags=(--systems cuda_ipc --shared-gpu-pace-ms "$pace"
                   --shared-gpu-pace-tokens "$tokens")
            [ "${run#colocated}" != "$run" ] && flags=(--systems colocated)
            timed_serve "pace_$run" "${PACE_S:-150}" "${flags[@]}"
        done
        ;;
    streams)
        for run in ${STREAMS_RUNS:-colocated_1 shared_1 per-request_1 shared_2 per-request_2 \
                colocated_2}; do
            mode=${run%_*}
            flags=(--systems cuda_ipc --prefill-streams "$mode")
            [ "$mode" = colocated ] && flags=(--systems colocated)
            timed_serve "streams_$run" "${STREAMS_S:-150}" "${flags[@]}"
        done
        ;;
    parts)
        for gap in 1 20 60; do
            python3 -m pdserve.bench.grpc_ping --calls 300 --gap-ms $gap
        done | tee "$R/grpc_ping.txt"
        mkdir -p "$W/tl_parts"
        PDSERVE_STEP_TIMELINE=$W/tl_parts OUT=$W/parts timeout "${SERVE_S:-330}" \
            bash pdserve/bench/gpu_kit_run.sh --systems colocated,cuda_ipc \
            --api-server-count 4 --colocated-api-servers 4 --request-rate "${RATES:-16,16}" \
            > "$W/parts.txt" 2>&1
        tail -10 "$W/parts.txt"
        cp "$W/parts/gpu_serve.json" "$R/parts_gpu_serve.json"
        runs=$(python3 -c "import json,sys; print(len(json.load(open(sys.argv[1]))['runs']))" \
            "$W/parts/loadtest_cuda_ipc.json")
        for ((run = 0; run < runs; run++)); do
            python3 -m pdserve.bench.ttft_breakdown "$W/parts/loadtest_cuda_ipc.json" \
                "$W/parts/cluster_cuda_ipc.log" --run $run > "$R/parts_breakdown_$run.json"
            python3 -c "import json,sys; d=json.load(open(sys.argv[1]))['ms']
print('run', sys.argv[2], ', '.join(f'{k} {v[\"p50\"]}' for k, v in d.items()))" \
                "$R/parts_breakdown_$run.json" $run
        done
        ;;
    core)
        for core in ${CORES:-thread}; do
            mkdir -p "$W/tl_b_$core"
            (
                export PDSERVE_STEP_TIMELINE=$W/tl_b_$core
                OUT=$W/b_$core timeout "${CORE_S:-200}" bash pdserve/bench/gpu_kit_run.sh \
                    --systems cuda_ipc --prefill-engine-core "$core" "${SERVE[@]}"
            ) > "$W/serve_b_$core.txt" 2>&1
            tail -8 "$W/serve_b_$core.txt"
            cp "$W/b_$core/gpu_serve.json" "$R/b_${core}_gpu_serve.json"
        done
        ;;
    burst)
        for core in thread process; do
            mkdir -p "$W/pb_$core"
            (
                export PDSERVE_STACK_SAMPLES=$W/pb_$core PDSERVE_STACK_SAMPLE_WHILE=$W/pb_gate \
                    PDSERVE_STACK_SAMPLE_HZ=${HZ:-400}
                timeout "${BURST_S:-120}" python3 -m pdserve.bench.prefill_burst --device cuda \
                    --transport cuda_ipc --rounds 6 --prompts 96 --engine-core $core \
                    --output-json "$R/burst_$core.json"
            ) > "$W/burst_$core.txt" 2>&1
            tail -3 "$W/burst_$core.txt"
            for f in "$W"/pb_$core/prefill-*.cpu.json; do echo "== $f"; head -8 "$f"; done
        done
        ;;
    esac
done
# A device call brings back at most 8 files: past 7, the parts' results travel as one archive
if [ "$(find "$R" -type f | wc -l)" -gt 7 ]; then
    tar czf /tmp/results.tgz -C "$R" . && rm -rf "${R:?}"/* && mv /tmp/results.tgz "$R/"
fi
tar czf "$R/runs.tgz" -C /tmp o
exit $status
