#!/usr/bin/env bash
# Build .gpu-nixl/nixl.tar.xz, NIXL for a lent GPU machine (Python 3.12, CUDA 13), small enough
# to carry beside .gpu-kit: the nixl-cu13 wheel is 58 MB (237 MB unpacked, most of it
# nixl_ep_cu13 and storage plugins); pdserve's nixl plane needs its Python API, libnixl, the UCX
# backend plugin and UCX's shared-memory (cma) and CUDA transports, and what they link: ~44 MB
# unpacked, ~8 MB as .tar.xz. Run it HERE, on the CPU box, from anywhere in the checkout; on the
# device, `source pdserve/bench/gpu_nixl_env.sh` unpacks it (gpu_kv_run.sh does when carried).
#
# Environment: NIXL_VERSION (default 1.5.1).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
DIR=.gpu-nixl
NIXL_VERSION=${NIXL_VERSION:-1.5.1}
exclude=$(git rev-parse --git-path info/exclude)
grep -qxF "/$DIR/" "$exclude" 2>/dev/null || echo "/$DIR/" >>"$exclude"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 -d "$work" "nixl-cu13==$NIXL_VERSION"
(cd "$work" && python3 -m zipfile -e nixl_cu13-*.whl unpacked)
# the shared objects these load, followed through their NEEDED entries within the wheel
python3 - "$work/unpacked" >"$work/files" <<'PY'
import os, subprocess, sys
os.chdir(sys.argv[1])
dirs = ["nixl_cu13.libs", ".nixl_cu13.mesonpy.libs", "nixl_cu13.libs/ucx", "nixl_cu13.libs/nixl"]
index = {}
for d in dirs:
    for f in os.listdir(d):
        if ".so" in f and os.path.isfile(os.path.join(d, f)):
            index.setdefault(f, os.path.join(d, f))
roots = ["nixl_cu13/_bindings.cpython-312-x86_64-linux-gnu.so",
         "nixl_cu13/_utils.cpython-312-x86_64-linux-gnu.so",
         "nixl_cu13.libs/nixl/libplugin_UCX.so", ".nixl_cu13.mesonpy.libs/plugins/libplugin_UCX.so",
         "nixl_cu13.libs/ucx/libuct_cma.so.0.0.0", "nixl_cu13.libs/ucx/libuct_cuda.so.0.0.0",
         "nixl_cu13.libs/ucx/libucm_cuda.so.0.0.0"]
seen, todo = set(), list(roots)
while todo:
    path = todo.pop()
    if path in seen:
        continue
    seen.add(path)
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True,
                         check=True).stdout
    for line in out.splitlines():
        if "(NEEDED)" in line:
            name = line.split("[", 1)[1].split("]", 1)[0]
            if name in index:
                todo.append(index[name])
files = sorted(seen) + sorted(f"nixl_cu13/{f}" for f in os.listdir("nixl_cu13")
                              if f.endswith(".py"))
print("\n".join(files))
PY
mkdir -p "$DIR"
tar -C "$work/unpacked" -cJf "$DIR/nixl.tar.xz" -T "$work/files"
echo "$DIR/nixl.tar.xz: $(wc -l <"$work/files") files, $(du -h "$DIR/nixl.tar.xz" | cut -f1)"
