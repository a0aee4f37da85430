"""Build a C kernel file once per machine with the system's C compiler and hand back the shared
object's path (kernels/cpu_nibble.py, kernels/cpu_attention.py load theirs with ctypes).

The file is named by a hash of the source, the flags, the compiler's version and, for flags that
target the build machine (`-march=native`), the CPU's feature flags, so that a cache folder shared
between machines never hands one CPU another's instructions. Workers starting together may build
at once: each compiles to a temporary name, then renames it atomically."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path

from kernels.cache_root import cache_root

log = logging.getLogger(__name__)
EXP_HEADER = Path(__file__).with_name("cpu_exp.h")  # e^x, #included by the kernels using it


def cpu_flags() -> str:
    """The first processor's feature flags from /proc/cpuinfo ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def build(source: Path, flags: list[str], out_dir: Path | None = None,
          includes: tuple[Path, ...] = ()) -> Path:
    """Compile `source` with `flags` (once) and return the shared object's path; raises OSError
    or subprocess.CalledProcessError (its stderr holds the compiler's message) on failure.
    `includes`: the files `source` #includes, hashed with it."""
    cc = os.environ.get("CC") or "cc"
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    key = b"".join(p.read_bytes() for p in (source, *includes))
    key += " ".join(flags).encode() + version.encode()
    if "-march=native" in flags:
        key += cpu_flags().encode()
    digest = hashlib.sha256(key).hexdigest()[:16]
    out_dir = out_dir or Path(cache_root()) / "cpu_kernels"
    target = out_dir / f"{source.stem}-{digest}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        subprocess.run([cc, *flags, str(source), "-o", tmp], capture_output=True, text=True,
                       check=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load(source: Path, flags: list[str], instead: str,
         includes: tuple[Path, ...] = ()) -> ctypes.CDLL | None:
    """`source` built (`build`) and loaded, or None if either fails, logged with `instead`
    (what serves in its place); the caller sets the functions' argtypes."""
    try:
        return ctypes.CDLL(str(build(source, flags, includes=includes)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        log.warning("could not build %s (%s); %s", source.name, detail.strip()[:500], instead)
        return None
