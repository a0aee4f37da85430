"""Kernels compiled for sm_90 on the CPU: a script run in a process without TRITON_INTERPRET
(the interpreter runs what the compiler refuses), its printed `name value` lines returned."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def compile_for_hopper(script: str) -> dict[str, str]:
    """Run `script` (which compiles with triton.compile(..., GPUTarget("cuda", 90, 32)) and
    prints one `name value` line per kernel) in a fresh process; skips without the NVIDIA
    backend, fails with its stderr."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], env=env, text=True,
                          capture_output=True, timeout=300, cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(line.split() for line in done.stdout.splitlines())
