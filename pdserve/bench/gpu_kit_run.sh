#!/usr/bin/env bash
# The device call of the GPU serving comparison (docs/loadtest.md, GPU section): on a lent GPU
# machine, from the checkout, with .gpu-kit carried (built here by pdserve/bench/gpu_kit.sh):
#
#   run(kind="nvidia-h100-x1", carry=[".gpu-kit"], command="bash pdserve/bench/gpu_kit_run.sh")
#
# It installs the kit's wheels into /tmp/site (ahead of the image's packages on PYTHONPATH),
# says what the machine has, and runs every system with the kit's redis-server and tokenizer,
# writing into $OUT. Arguments go on to `python -m pdserve.bench.gpu_serve`, e.g.
# `--systems grpc,cuda_ipc` or `--request-rate 16,32,inf`.
set -euo pipefail
cd "$(dirname "$0")/../.."
KIT=${KIT:-.gpu-kit}
SITE=${SITE:-/tmp/site}
if [ ! -x "$KIT/redis-server" ]; then
    echo "gpu_kit_run.sh: no $KIT here: build it with pdserve/bench/gpu_kit.sh, carry it" >&2
    exit 2
fi
python3 -m pip install -q --root-user-action=ignore --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target "$SITE" "$KIT"/whl/*.whl
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
"$KIT/redis-server" --version
python3 -c 'import sys, torch, transformers, triton, grpc, fastapi, pydantic, redis, uvicorn
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda",
      torch.cuda.is_available(), "transformers", transformers.__version__, "triton",
      triton.__version__, "grpcio", grpc.__version__, "fastapi", fastapi.__version__)'
exec python3 -m pdserve.bench.gpu_serve --redis-server "$KIT/redis-server" \
    --tokenizer "$KIT/tokenizer" --out-dir "${OUT:-bench_results/gpu_serve}" "$@"
