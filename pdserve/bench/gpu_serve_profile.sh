#!/usr/bin/env bash
# Where a split cluster's time goes under pdserve/bench/gpu_kit_run.sh's load: beside the run,
# every pdserve process's CPU share (pdserve.bench.proc_cpu) and, for the prefill and the decode
# worker, py-spy's samples of the thread holding the GIL (collapsed stacks, one line a stack:
# what each worker's interpreter is busy with, whichever thread runs it). Run on a lent GPU
# machine, from the checkout, with .gpu-kit carried:
#
#   run(carry=[".gpu-kit"], command="bash pdserve/bench/gpu_serve_profile.sh --systems cuda_ipc
#       --api-server-count 4")
#
# Into $OUT: what gpu_kit_run.sh writes, proc_cpu.json, {prefill,decode}_gil.txt and py-spy's
# own output ({prefill,decode}_pyspy.log: its errors and sample counts). Arguments go on
# to gpu_kit_run.sh. py-spy starts when the load generator does (`-m loadtest`) and samples for
# PROFILE_S seconds (default 14: the 16 req/s run's ~7 s and the all-at-once run's ~3 s).
# PYSPY_FLAGS (default --gil) picks what py-spy samples: "--idle" or "" for every thread's
# stack, whether it holds the GIL or not. PROFILE_ROLES (default "prefill decode") names the
# processes sampled: a `pdserve` subcommand (serve: the colocated server), or core (the
# colocated server's engine core process, with --engine-core process).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench_results/gpu_serve}
SITE=${SITE:-/tmp/site}
PROFILE_S=${PROFILE_S:-14}
PYSPY_FLAGS=${PYSPY_FLAGS---gil}
PROFILE_ROLES=${PROFILE_ROLES:-prefill decode}
mkdir -p "$OUT"
bash pdserve/bench/gpu_kit_run.sh --out-dir "$OUT" "$@" &
run=$!
sleep 5  # the kit's wheels are installed into $SITE first
export PYTHONPATH="$SITE:$PWD"
python3 -m pdserve.bench.proc_cpu --match pdserve,engine.core_process --interval 0.25 --out "$OUT/proc_cpu.json" &
sampler=$!
profile() {  # $1: a subcommand, or core; waits for the load, then samples that process
    local pid="" pattern="pdserve.cli $1 "
    [ "$1" = core ] && pattern="[e]ngine.core_process"
    while ! pgrep -f "[-]m loadtest" >/dev/null && kill -0 "$run" 2>/dev/null; do sleep 0.2; done
    pid=$(pgrep -f "$pattern" | head -1)
    [ -n "$pid" ] && "$SITE/bin/py-spy" record --pid "$pid" $PYSPY_FLAGS --rate 200 --nonblocking \
        --duration "$PROFILE_S" --format raw --output "$OUT/$1_gil.txt" >"$OUT/$1_pyspy.log" 2>&1
}
for role in $PROFILE_ROLES; do profile "$role" & done
wait "$run"
status=$?
kill -TERM "$sampler" 2>/dev/null
wait
exit $status
