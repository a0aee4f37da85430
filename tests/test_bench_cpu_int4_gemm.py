"""pdserve.bench.cpu_int4_gemm: a row per format, shape and row count, every path that runs
here timed (the nibble kernel's where it builds, torch's int4 where torch has it)."""

from __future__ import annotations

import json

import pytest

from engine.quant.kernels import int4pack_available
from kernels import cpu_nibble
from pdserve.bench import cpu_int4_gemm


@pytest.mark.skipif(not int4pack_available() and not cpu_nibble.available(),
                    reason="no CPU GEMM over GGUF codes here")
def test_every_shape_and_row_count_is_timed(tmp_path) -> None:
    out = tmp_path / "r.json"
    argv = ["--shapes", "128x64,64x128", "--q8-shapes", "32x64", "--rows", "1,3", "--repeats",
            "2", "--stream-mib", "1", "--output-json", str(out)]
    assert cpu_int4_gemm.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["nibble"] == cpu_nibble.available()
    rows = report["rows"]
    assert [(r["format"], r["n"], r["k"], r["m"]) for r in rows] == [
        ("Q4_1", 128, 64, 1), ("Q4_1", 128, 64, 3), ("Q4_1", 64, 128, 1), ("Q4_1", 64, 128, 3),
        ("Q8_0", 32, 64, 1), ("Q8_0", 32, 64, 3)]
    for r in rows:
        assert r["bf16_ms"] > 0
        assert ("nibble_ms" in r) == ("nibble_mem_ms" in r) == cpu_nibble.available()
        assert ("int4_ms" in r) == ("int4_mem_ms" in r) == int4pack_available()
        if "nibble_ms" in r and "int4_ms" in r:
            assert r["int4_over_nibble"] == pytest.approx(r["int4_ms"] / r["nibble_ms"])
