"""engine/quant/ggml_types.py: gguf's constants without the rest of the package."""

from __future__ import annotations

import subprocess
import sys


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_constants_load_without_the_gguf_package_and_are_its_own_objects() -> None:
    out = _run(
        "import sys\n"
        "from engine.quant.ggml_types import GGML_QUANT_SIZES, GGMLQuantizationType as Q\n"
        "print('gguf' in sys.modules, 'sentencepiece' in sys.modules, 'yaml' in sys.modules,\n"
        "      GGML_QUANT_SIZES[Q.Q8_0])\n"
        "import gguf\n"
        "print(gguf.GGMLQuantizationType is Q, gguf.GGML_QUANT_SIZES is GGML_QUANT_SIZES,\n"
        "      gguf.quants.dequantize is not None)\n")
    assert out.splitlines() == ["False False False (32, 34)", "True True True"]


def test_a_gguf_package_imported_first_is_used_as_it_is() -> None:
    out = _run("import gguf\nfrom engine.quant.ggml_types import GGMLQuantizationType as Q\n"
               "print(Q is gguf.GGMLQuantizationType)")
    assert out == "True"
