"""pdserve.bench.gpu_quant's weights-read floors and serving settings (no engine run)."""

from __future__ import annotations

import pytest

from pdserve.bench.gpu_model import BF16_BYTES, ModelShape
from pdserve.bench.gpu_quant import weight_bytes


def test_floors_count_each_format_s_bytes() -> None:
    shape = ModelShape()  # the 1B shape: 16 layers, the tied 128k x 2048 embedding
    projections = shape.layers * shape.layer_weights
    rest = (shape.params - projections) * BF16_BYTES
    assert weight_bytes(shape, "bf16") == shape.params * BF16_BYTES
    # fp8: a byte a weight plus an fp32 scale per output row
    assert weight_bytes(shape, "fp8") - rest - projections == pytest.approx(
        4 * shape.layers * (3072 + 2048 + 2 * 8192 + 2048))
    # w4a16: half a byte a weight plus 2.5 bytes (fp16 scale, 4-bit zero) per group of 128
    extra = weight_bytes(shape, "w4a16") - rest - projections // 2
    assert extra == pytest.approx(2.5 * projections / 128, rel=1e-3)


def test_unknown_system_is_refused() -> None:
    import argparse

    from pdserve.bench import gpu_quant

    parser = argparse.ArgumentParser()
    gpu_quant.add_arguments(parser)
    with pytest.raises(ValueError, match="unknown \\['int3'\\]"):
        gpu_quant.run(parser.parse_args(["--systems", "bf16,int3"]))


def test_w4a16_fused_is_served_with_the_prologues_on_and_nothing_else() -> None:
    from engine.quant.w4a16_linear import W4A16Linear
    from pdserve.bench.gpu_quant import serving

    assert W4A16Linear.prologues is False  # the default the layer serves with
    with serving("w4a16_fused"):
        assert W4A16Linear.prologues is True
    with serving("w4a16"):
        assert W4A16Linear.prologues is False
    with pytest.raises(RuntimeError), serving("w4a16_fused"):
        raise RuntimeError("an engine that failed")
    assert W4A16Linear.prologues is False


def test_w4a16_fp32_is_served_with_the_fp32_loop_and_nothing_else() -> None:
    from engine.quant.w4a16_linear import W4A16Linear
    from pdserve.bench.gpu_quant import serving

    assert W4A16Linear.pairs is True  # the default the layer serves with
    with serving("w4a16_fp32"):
        assert W4A16Linear.pairs is False and W4A16Linear.prologues is False
    with serving("w4a16_fused"):
        assert W4A16Linear.pairs is True and W4A16Linear.stages == 1
    with serving("w4a16_st3"):
        assert W4A16Linear.stages == 3 and W4A16Linear.pairs is True
    with serving("w4a16_tma"):
        assert W4A16Linear.stages == 3 and W4A16Linear.tma is True
    assert W4A16Linear.stages == 1 and W4A16Linear.tma is False
    with pytest.raises(RuntimeError), serving("w4a16_fp32"):
        raise RuntimeError("an engine that failed")
    assert W4A16Linear.pairs is True


def test_hostargmax_systems_serve_without_argmax_graphs_and_their_base_otherwise() -> None:
    from engine.cuda_graphs import DecodeGraphs
    from engine.quant.w4a16_linear import W4A16Linear
    from pdserve.bench.gpu_quant import TARGET_MS, engine_for, serving

    default = DecodeGraphs.argmax_max_batch
    assert default > 0
    with serving("w4a16_fp32_hostargmax"):
        assert DecodeGraphs.argmax_max_batch == 0 and W4A16Linear.pairs is False
    with serving("w4a16"):
        assert DecodeGraphs.argmax_max_batch == default
    with pytest.raises(RuntimeError), serving("bf16_hostargmax"):
        raise RuntimeError("an engine that failed")
    assert DecodeGraphs.argmax_max_batch == default and W4A16Linear.pairs is True
    base = object()
    assert engine_for("bf16_hostargmax", base, {}) is base  # the bf16 folder as it is
    assert TARGET_MS["w4a16_hostargmax"] == TARGET_MS["w4a16"]
