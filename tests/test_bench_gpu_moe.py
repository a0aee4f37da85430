"""The MoE GPU benchmark's CPU-runnable parts: arguments, roofline arithmetic, and a dry run
end to end (tiny shape, the fused kernel through Triton's interpreter)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from pdserve.bench.gpu_moe import (
    DEFAULT_TOKENS,
    MoEShape,
    add_arguments,
    layer_bytes,
    main,
    plan,
    roofline_ms,
)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_mixtral_shaped_layer_reads_its_touched_experts() -> None:
    shape = MoEShape()
    assert shape.expert_bytes(2) == 3 * 2048 * 7168 * 2 == 88_080_384
    assert shape.model_expert_bytes(2) / 2**30 == pytest.approx(10.5, abs=0.01)  # fits an H100
    # 256 tokens touch all 8 experts: 8 experts' weights plus x in and out (256 x 2048 bf16)
    assert layer_bytes(shape, 8, 256, 2) == 8 * 88_080_384 + 2 * 256 * 2048 * 2
    assert roofline_ms(shape, 8, 256, 2, 3.0e12) == pytest.approx(0.235580, abs=1e-6)
    assert roofline_ms(shape, 2, 1, 2, 3.0e12) == pytest.approx(2 * 88_080_384 / 3e9, rel=1e-3)


def test_arguments_and_plan() -> None:
    assert _args().tokens is None and _args("--tokens", "1,8").tokens == (1, 8)
    with pytest.raises(SystemExit):
        _args("--tokens", "0,4")
    shape, tokens, device, _ = plan(_args("--dry-run", "--device", "cpu"))
    assert shape.hidden == 32 and device.type == "cpu" and tokens == (1, 4, 16)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        plan(_args("--device", "cpu"))
    assert DEFAULT_TOKENS == (1, 64, 256)


def test_dry_run_writes_the_report(tmp_path, capsys) -> None:
    """On the GPU when there is one: where CUDA is, Triton was imported without its interpreter,
    so the kernels cannot take CPU tensors."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert main(["--dry-run", "--device", device, "--tokens", "2", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench_gpu_moe.json").read_text())
    (row,) = report["layers"]
    assert row["tokens"] == 2 and 2 <= row["touched_experts"] <= 4
    assert row["fused_ms"] > 0 and row["loop_ms"] > 0 and row["roofline_ms"] > 0
    assert row["rel_err"] < 1e-5  # fp32: the fused kernel equals the loop
    assert "fused MoE layer" in capsys.readouterr().out


def test_tuner_candidates_and_its_need_for_a_gpu() -> None:
    from pdserve.bench import gpu_moe_tune

    assert gpu_moe_tune.block_ms(1, 2, 8) == (16,)  # decode: 16-row tiles only
    assert gpu_moe_tune.block_ms(64, 2, 8) == (16, 32)
    assert gpu_moe_tune.block_ms(256, 2, 8) == (32, 64)
    configs = gpu_moe_tune.candidates(64)
    assert len(configs) == 14 and all(c[0] == 64 for c in configs)
    if not torch.cuda.is_available():
        assert gpu_moe_tune.main(["--pieces-only"]) == 2  # a usage error, not a traceback
