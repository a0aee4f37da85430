#!/usr/bin/env bash
# The device call of the KV data-plane checks and benchmark (docs/benchmarks.md, "KV data
# planes"): on a lent GPU machine, from the checkout, with .gpu-kit carried (built here by
# pdserve/bench/gpu_kit.sh):
#
#   run(kind="nvidia-h100-x1", carry=[".gpu-kit"], command="bash pdserve/bench/gpu_kv_run.sh")
#
#   1. the GPU tests of the data plane: the block-copy kernel, cuda_ipc between two worker
#      processes sharing the GPU (tokens, restarts, kills), and the CUDA path (the KV pool is one
#      allocation now)
#   2. `pdserve bench transfer` on the GPU: one request's KV of the 1B shape (16 layers, 8 KV
#      heads of 64, bf16: 32 KiB a token) at 1k / 4k / 16k tokens over grpc and cuda_ipc, against
#      the device copy and block-scatter bandwidth measured in the same run; over nixl too when
#      .gpu-nixl is carried (built here by pdserve/bench/gpu_nixl_kit.sh): VRAM to VRAM
#   3. the block-copy kernel's settings against copy_ and index_copy_ (pdserve.bench.gpu_kv_copy)
# Reports and logs go to $OUT. TESTS=0 skips step 1; GPU_TESTS names other test files;
# TRANSPORTS overrides step 2's list; COPY=0 skips step 3. Arguments go to step 2 (e.g.
# `--busy 4` for a loaded decode worker; with PDSERVE_HANDOVER_TRACE=1 in the environment the
# handover is also read from the decode worker's stamps, docs/benchmarks.md).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench_results/gpu_kv}
mkdir -p "$OUT"
source pdserve/bench/gpu_kit_env.sh || exit 1
export PDSERVE_TEST_TOKENIZER="$PWD/$KIT/tokenizer"
TRANSPORTS=${TRANSPORTS:-grpc,cuda_ipc}
if [ -f .gpu-nixl/nixl.tar.xz ]; then
    # shellcheck source=pdserve/bench/gpu_nixl_env.sh
    if source pdserve/bench/gpu_nixl_env.sh; then TRANSPORTS="$TRANSPORTS,nixl"; fi
fi
status=0
if [ "${COPY:-1}" = 1 ]; then
    python3 -m pdserve.bench.gpu_kv_copy --out "$OUT" 2>&1 | tee "$OUT/gpu_kv_copy.log"
fi
if [ "${TESTS:-1}" = 1 ]; then
    python3 -m pytest -q -p no:cacheprovider ${GPU_TESTS:-tests/test_kernels_kv_copy.py \
        tests/test_kv_cuda_ipc.py tests/test_transport.py tests/test_cuda_path.py} 2>&1 \
        | tee "$OUT/gpu_tests.log" | tail -40
    status=${PIPESTATUS[0]}
fi
MODEL=/tmp/model-1b-16k
[ -f "$MODEL/config.json" ] || python3 - "$MODEL" <<'PY'
import sys
from pathlib import Path
from pdserve.bench.gpu_model import ModelShape, save_stand_in_tokenizer
from pdserve.bench.gpu_serve import build_model
shape = ModelShape(max_positions=16384 + 64)  # the 1B shape, long enough for 16k tokens
build_model(shape, sys.argv[1], 0)
save_stand_in_tokenizer(shape.vocab, Path(sys.argv[1]))
PY
python3 -m pdserve.bench.transfer --model "$MODEL" --device cuda --num-layers 16 \
    --num-kv-heads 8 --head-dim 64 --dtype bfloat16 --kv-tokens 1024,4096,16384 \
    --transport "$TRANSPORTS" --slab-mib 2,8 --plane-slab-mib 2,32,256 --repeats 5 \
    --output-json "$OUT/transfer_h100.json" "$@" 2>&1 | tee "$OUT/transfer.log" | grep -v " INFO "
exit $status
