# Sourced on a lent GPU machine (after gpu_kit_env.sh) when .gpu-nixl is carried: unpack NIXL
# (built here by pdserve/bench/gpu_nixl_kit.sh) into $NIXL_SITE, put it on PYTHONPATH, point
# NIXL at its UCX plugin and the loader at the CUDA 13 runtime of the image's torch wheels.
NIXL_SITE=${NIXL_SITE:-/tmp/nixl-site}
mkdir -p "$NIXL_SITE" && tar -C "$NIXL_SITE" -xJf .gpu-nixl/nixl.tar.xz || return 1
export PYTHONPATH="$NIXL_SITE:$PYTHONPATH" NIXL_PLUGIN_DIR="$NIXL_SITE/nixl_cu13.libs/nixl"
cudart=$(python3 - <<'PY'
import glob, os, site
for root in site.getsitepackages():
    for path in glob.glob(os.path.join(root, "nvidia", "**", "libcudart.so.13*"), recursive=True):
        print(os.path.dirname(path))
        raise SystemExit
PY
)
export LD_LIBRARY_PATH="${cudart:+$cudart:}${LD_LIBRARY_PATH:-}"
python3 -c "import nixl_cu13; print('nixl_cu13 loads from', nixl_cu13.__file__)" || return 1
