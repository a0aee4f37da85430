#!/usr/bin/env bash
# The colocated server with its engine loop in a thread of the server's process against a
# process of its own (`pdserve serve --engine-core thread|process`), alternated, on this machine
# (the CPU box by default: the bundled model), each run a fresh server under the same load:
#
#   OUT=/tmp/ec ROUNDS=2 bash pdserve/bench/engine_core_ab.sh [extra pdserve serve flags]
#
# SPLIT=1: the same for the split cluster's decode worker (`pdserve up --engine-core
# thread|process`: 1 prefill + 1 decode worker, a gateway, a tokenizer, Redis; extra flags are
# pdserve up's).
#
# Into $OUT: {mode}_{round}.json (python -m loadtest's reports) and the servers' logs; prints
# each run's summary line. Load: 96 prompts of 64 tokens, 64 output tokens each, all at once,
# at most 48 in flight (LOAD overrides the load generator's flags).
# MODES: the engine cores to run, in order (default "thread process").
set -euo pipefail
OUT=${OUT:-bench_results/engine_core}
ROUNDS=${ROUNDS:-2}
PORT=${PORT:-8078}
LOAD=${LOAD:---request-rate inf --num-prompts 96 --input-len 64 --output-len 64 --max-concurrency 48 --num-warmups 2}
mkdir -p "$OUT"
for round in $(seq "$ROUNDS"); do
    for mode in ${MODES:-thread process}; do
        if [ "${SPLIT:-0}" = 1 ]; then
            server_cmd=(pdserve up)
        else
            server_cmd=(pdserve serve --max-num-seqs 64)
        fi
        "${server_cmd[@]}" --engine-core "$mode" --port "$PORT" --kv-cache-memory $((256 << 20)) \
            --max-model-len 512 --log-level warning "$@" \
            >"$OUT/serve_${mode}_$round.log" 2>&1 &
        server=$!
        for _ in $(seq 180); do curl -sf "localhost:$PORT/ready" >/dev/null && break; sleep 1; done
        # shellcheck disable=SC2086
        python -m loadtest --base-url "http://127.0.0.1:$PORT" $LOAD --no-plots --no-progress \
            --output-json "$OUT/${mode}_$round.json" >"$OUT/loadtest_${mode}_$round.txt" 2>&1
        kill -TERM "$server"
        wait "$server" || true
        echo "$mode round $round: $(tail -2 "$OUT/loadtest_${mode}_$round.txt" | head -1)"
    done
done
