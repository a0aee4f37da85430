"""pdserve's top-level `kernels` package against Hugging Face's package of the same import name.

transformers probes `kernels` by its distribution's version and, inside its range, imports names
from it (transformers.integrations.hub_kernels, imported by modeling_utils). With Hugging Face's
distribution installed (transformers 5.25 requires it) that import reaches pdserve's package and
fails, and outside the repository's folder `import kernels` can load Hugging Face's instead.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_no_distribution_named_kernels_is_installed():
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("kernels")


def test_transformers_models_import_beside_pdserve_kernels():
    import transformers.integrations.hub_kernels  # noqa: F401 - raised ImportError with 5.25
    from transformers.utils.import_utils import is_kernels_available

    import kernels
    assert Path(kernels.__file__).parent == REPO / "kernels"
    assert not is_kernels_available()


def test_kernels_is_pdserves_from_any_folder(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", "import kernels, kernels.rmsnorm; print(kernels.__file__)"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=True)
    assert Path(out.stdout.strip()).parent == REPO / "kernels", out.stdout
