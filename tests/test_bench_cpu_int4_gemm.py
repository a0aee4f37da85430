"""pdserve.bench.cpu_int4_gemm: a row per shape and row count, every path timed."""

from __future__ import annotations

import json

import pytest
import torch

from engine.quant.int4_dense import dense_supported
from engine.quant.kernels import Int4PackKernel, int4pack_available
from pdserve.bench import cpu_int4_gemm


@pytest.mark.skipif(not int4pack_available(), reason="no packed int4 CPU kernel")
def test_every_shape_and_row_count_is_timed(tmp_path) -> None:
    out = tmp_path / "r.json"
    argv = ["--shapes", "128x64,64x128", "--rows", "1,3", "--repeats", "2", "--output-json",
            str(out)]
    assert cpu_int4_gemm.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["n"], r["k"], r["m"]) for r in rows] == [(128, 64, 1), (128, 64, 3), (64, 128, 1),
                                                         (64, 128, 3)]
    for r in rows:
        packed = Int4PackKernel(torch.zeros(r["n"], r["k"], dtype=torch.int32),
                                torch.ones(r["n"], r["k"] // 32), torch.zeros(r["n"], r["k"] // 32))
        assert r["int4_ms"] > 0 and r["bf16_ms"] > 0
        assert (r["dense_path_ms"] is not None) == dense_supported(packed.packed)
