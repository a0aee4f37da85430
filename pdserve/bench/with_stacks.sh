#!/usr/bin/env bash
# Run a command for at most LIMIT_S seconds; if it is still running 20 s before then, write
# every Python process's stacks (py-spy dump, the kit's py-spy) to STACKS, then stop it. A
# device call that hangs then says where each process (each tensor-parallel rank) waited.
#
#   bash pdserve/bench/with_stacks.sh LIMIT_S STACKS command [args...]
#
# Exit status: the command's, or 124 when stopped.
set -uo pipefail
LIMIT=${1:?usage: with_stacks.sh LIMIT_S STACKS command...}
STACKS=${2:?usage: with_stacks.sh LIMIT_S STACKS command...}
shift 2
PY_SPY=$(command -v py-spy || echo "${SITE:-/tmp/site}/bin/py-spy")
set -m  # the command and its children: a process group of their own, stopped together
"$@" &
pid=$!
deadline=$((SECONDS + LIMIT - 20))
while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 1; done
if kill -0 "$pid" 2>/dev/null; then
    echo "with_stacks: still running after $((LIMIT - 20)) s; stacks in $STACKS" >&2
    for p in $(pgrep -f python); do
        [ "$p" = "$$" ] && continue
        { echo "=== pid $p: $(tr '\0' ' ' </proc/"$p"/cmdline 2>/dev/null | cut -c1-200)"
          timeout 5 "$PY_SPY" dump --pid "$p" 2>&1; } >>"$STACKS"
    done
    kill -TERM -- -"$pid" 2>/dev/null
    sleep 3; kill -KILL -- -"$pid" 2>/dev/null
    exit 124
fi
wait "$pid"
