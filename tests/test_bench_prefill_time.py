"""pdserve.bench.prefill_time: every length timed for every way, the dense threshold restored."""

from __future__ import annotations

import json

import pytest

from engine.quant import kernels
from engine.quant.int4_dense import DENSE_MIN_TOKENS
from pdserve.bench import prefill_time


def test_ab_dense_times_both_ways_and_restores_the_threshold(tmp_path, monkeypatch) -> None:
    seen = []
    for kernel, method in ((kernels.Int4PackKernel, "bf16"), (kernels.NibbleKernel, "__call__")):
        real = getattr(kernel, method)
        monkeypatch.setattr(kernel, method, lambda self, x, real=real: seen.append(
            kernels.DENSE_MIN_TOKENS) or real(self, x))
    out = tmp_path / "r.json"
    assert prefill_time.main(["--lens", "5,9", "--repeats", "2", "--kv-cache-mib", "16",
                              "--ab-dense", "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    for way in ("dense", "int4"):
        assert {n: len(t) for n, t in report["seconds"][way].items()} == {"5": 2, "9": 2}
    assert set(seen) == {DENSE_MIN_TOKENS, 1 << 62}  # the bundled GGUF's GEMMs saw both
    assert kernels.DENSE_MIN_TOKENS == DENSE_MIN_TOKENS


def test_bad_lengths_are_a_usage_error(tmp_path) -> None:
    assert prefill_time.main(["--lens", "0", "--output-json", str(tmp_path / "r.json")]) == 2
    with pytest.raises(SystemExit):
        prefill_time.main(["--repeats", "x"])
