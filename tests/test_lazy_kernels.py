"""engine/lazy_kernels.py: a CPU engine never imports triton, and every kernel the engine names
lazily exists (its CUDA-only call sites would otherwise fail only on a GPU)."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys

import engine
from engine.lazy_kernels import LazyKernel, has_triton

CPU_ENGINE = """
import sys
from pdserve import LLM, SamplingParams
llm = LLM(kv_cache_memory=12 << 20, max_model_len=256, device="cpu")
out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
assert len(out[0].outputs[0].token_ids) == 4
print(sorted(m for m in sys.modules if m == "triton" or m.startswith("triton.")))
"""


def test_a_cpu_engine_on_the_bundled_model_never_imports_triton():
    done = subprocess.run([sys.executable, "-c", CPU_ENGINE], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def _engine_lazy_kernels() -> dict[str, LazyKernel]:
    found = {}
    for info in pkgutil.walk_packages(engine.__path__, "engine."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if isinstance(value, LazyKernel):
                found[f"{info.name}.{name}"] = value
    return found


def test_every_lazily_named_kernel_resolves_to_a_callable():
    found = _engine_lazy_kernels()
    assert "engine.models.layers._fused_rms_norm" in found  # the walk sees them
    assert len(found) >= 15
    assert has_triton()  # CI installs it: the Triton kernels are tested in the interpreter
    for where, lazy in found.items():
        assert callable(lazy.resolve()), where
