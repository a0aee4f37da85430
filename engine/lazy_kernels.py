"""Triton kernels bound at their first call, so that a process on the CPU never imports triton.

NOTE: importing a kernels/ module that holds a `@triton.jit` kernel imports triton, about 70 MiB
resident and 0.2 s on the 2-core CPU box, and the engine's model, quantization and sampling
modules name a dozen such kernels at their top. They name them through `kernel(module, name)`:
a callable that imports `kernels.<module>` at its first call and forwards every call to the
kernel's launcher. The kernels are called on CUDA tensors only, so the CPU path never imports
them (tests/test_lazy_kernels.py checks a whole CPU engine). `has_triton` says whether triton is
installed, without importing it: the code that would call a kernel checks it first, as it
checked an ImportError before.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable
from typing import Any


@functools.cache
def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


class LazyKernel:
    """`kernels.<module>.<name>`, imported at the first call."""

    __slots__ = ("module", "name", "_fn")

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name
        self._fn: Callable[..., Any] | None = None

    def resolve(self) -> Callable[..., Any]:
        """The launcher itself (imports its module the first time)."""
        if self._fn is None:
            self._fn = getattr(importlib.import_module(f"kernels.{self.module}"), self.name)
        return self._fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn = self._fn if self._fn is not None else self.resolve()
        return fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"kernel(kernels.{self.module}.{self.name})"


def kernel(module: str, name: str) -> LazyKernel:
    return LazyKernel(module, name)
