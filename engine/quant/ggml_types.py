"""GGML's quantization types and block sizes, from the `gguf` package's constants module alone.

`import gguf` runs the package's `__init__`, which also imports its writer, its vocabulary
module (sentencepiece) and its metadata module (yaml): 4.3 MiB of resident memory and ~35 ms
that reading a file's tensor table and blocks never uses (measured 2026-12-04, the 2-core box,
after `import torch`). So the constants module is executed on its own, registered under its
own name: a later `import gguf` (its quantizer, its dequantizer) finds it in `sys.modules` and
uses these very objects. Where that module cannot load alone (another package version), the
package is imported as usual.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

NAME = "gguf.constants"


def _constants() -> ModuleType:
    if NAME in sys.modules:
        return sys.modules[NAME]
    package = importlib.util.find_spec("gguf")  # locates the package without running it
    if package is not None and package.origin is not None:
        spec = importlib.util.spec_from_file_location(
            NAME, Path(package.origin).parent / "constants.py")
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            sys.modules[NAME] = module
            try:
                spec.loader.exec_module(module)
                return module
            except ImportError:
                del sys.modules[NAME]
    import gguf.constants

    return gguf.constants


_module = _constants()
GGMLQuantizationType = _module.GGMLQuantizationType
GGML_QUANT_SIZES = _module.GGML_QUANT_SIZES
