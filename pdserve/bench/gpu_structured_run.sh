#!/usr/bin/env bash
# The device call of the structured-outputs benchmark (docs/benchmarks.md, "Structured
# outputs"): on a lent GPU machine, from the checkout, with .gpu-kit carried (built here by
# pdserve/bench/gpu_kit.sh; it holds xgrammar and the SmolLM2 tokenizer):
#
#   run(kind="nvidia-h100-x1", carry=[".gpu-kit"], command="bash pdserve/bench/gpu_structured_run.sh")
#
# `python -m pdserve.bench.structured` on the random 1B-shaped model in bf16 over the SmolLM2
# vocabulary: ms per decode step under a JSON schema against unconstrained decoding, at batch 1
# and 64, in one process (9 alternating rounds). The report goes to $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench_results/gpu_structured}
mkdir -p "$OUT"
source pdserve/bench/gpu_kit_env.sh || exit 1
python3 -m pdserve.bench.structured --device cuda --random-1b --tokenizer "$KIT/tokenizer" \
    --batches 1,64 --tokens 64 --rounds 9 --json "$OUT/structured.json" 2>&1 | tail -20
