#!/usr/bin/env bash
# Before / after on one machine: the same benchmark from a copy of an earlier commit and from
# the checkout, one process each, alternated, so that both see the same GPU, host and drift.
#
# Here (the copy is git-ignored, carried with the kit):
#   rm -rf .before && mkdir .before && git archive COMMIT | tar -x -C .before
#   grep -qxF /.before/ .git/info/exclude || echo /.before/ >> .git/info/exclude
# Device call:
#   run(carry=[".gpu-kit", ".before"], command="bash pdserve/bench/gpu_ab.sh 3 \
#       python3 -m pdserve.bench.structured --device cuda --random-1b --tokenizer \
#       .gpu-kit/tokenizer --batches 1,64 --rounds 5 --json '{json}'")
#
# Runs the command ROUNDS times in each tree (before first), with '{json}' replaced by
# $OUT/{before,after}_<i>.json; each process's last lines go to the log.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=$1
shift
OUT=${OUT:-bench_results/ab}
mkdir -p "$OUT"
source pdserve/bench/gpu_kit_env.sh >/dev/null || exit 1
HERE=$PWD
KIT_TOKENIZER=$HERE/.gpu-kit/tokenizer
for i in $(seq 1 "$ROUNDS"); do
    for side in before after; do
        tree=$HERE
        [ "$side" = before ] && tree=$HERE/.before
        args=()
        for a in "$@"; do
            a=${a//\{json\}/$OUT/${side}_$i.json}
            args+=("${a//.gpu-kit\/tokenizer/$KIT_TOKENIZER}")
        done
        echo "== $side $i"
        (cd "$tree" && PYTHONPATH="$SITE:$tree" "${args[@]}" 2>&1 | tail -4)
    done
done
