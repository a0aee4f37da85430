"""kernels/cpu_nibble: the GEMM over packed GGUF codes (its AVX512-BF16 path or its AVX2 one,
whichever this CPU builds) against its fp32 reference (every block shape: 6-row blocks, the last
rows, 4-, 2- and 1-tile jobs), a row's output the same whatever else is in the batch or the
thread count, the de-quantized W^T, the codes read back, the build cached and its failure
reported, and NibbleKernel against gguf's own de-quantization."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from test_quant_gguf import random_blocks

from engine.quant.blocks import QuantWeight, unpack
from engine.quant.kernels import NibbleKernel, reference_linear
from kernels import cpu_nibble

Q = GGMLQuantizationType
pytestmark = pytest.mark.skipif(not cpu_nibble.available(),
                                reason="no AVX2 or no C compiler here")


def _packed(fmt: int, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    groups = k // cpu_nibble.GROUP
    if fmt == cpu_nibble.Q4:
        codes = cpu_nibble.pack_q4(torch.randint(0, 16, (n, k), generator=g))
        zero = cpu_nibble.pack_groups(-torch.rand(n, groups, generator=g) * 0.1)
        return codes, cpu_nibble.pack_groups(torch.rand(n, groups, generator=g) * 0.02), zero
    codes = cpu_nibble.pack_q8(torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8))
    return codes, cpu_nibble.pack_groups(torch.rand(n, groups, generator=g) * 2e-3), None


@pytest.mark.parametrize("fmt", [cpu_nibble.Q4, cpu_nibble.Q8], ids=["q4", "q8"])
@pytest.mark.parametrize("n", [112, 48, 16])  # 7 tiles: a 4-, a 2- and a 1-tile job; 3; 1
@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 13])
def test_gemm_matches_the_reference_and_rows_are_independent(fmt: int, n: int, m: int) -> None:
    k = 96
    codes, s, z = _packed(fmt, n, k, seed=n + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
    ref = cpu_nibble.reference(x, fmt, codes, s, z, n)
    y = cpu_nibble.gemm(x, fmt, codes, s, z, n, torch.float32)
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()  # fp32 sums of exact products
    yb = cpu_nibble.gemm(x, fmt, codes, s, z, n, torch.bfloat16)
    assert torch.equal(yb, y.bfloat16())  # the bf16 output is the fp32 one rounded once
    # each row alone, and on one thread, gives the same bits as in the batch
    for r in range(m):
        assert torch.equal(cpu_nibble.gemm(x[r:r + 1], fmt, codes, s, z, n, torch.float32)[0],
                           y[r])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_nibble.gemm(x, fmt, codes, s, z, n, torch.float32), y)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("fmt", [cpu_nibble.Q4, cpu_nibble.Q8], ids=["q4", "q8"])
@pytest.mark.parametrize("m", [1, 5, 300])  # 300 rows: the prologue's buffer off the stack
@pytest.mark.parametrize("residual", [True, False], ids=["residual", "first_layer"])
def test_the_norm_and_swiglu_prologues_equal_the_ops_then_the_gemm(fmt: int, m: int,
                                                                    residual: bool) -> None:
    """Gemm.rmsnorm: r = x + residual exactly, then the GEMM of F.rms_norm(r) (within a bf16
    rounding of the normed rows: the C sum of squares runs in another order); Gemm.silu_mul:
    the GEMM of F.silu(gate) * up, the same way. Strided rows (views of wider rows) too."""
    n, k = 48, 64
    codes, s, z = _packed(fmt, n, k, seed=m)
    gemm = cpu_nibble.Gemm(fmt, codes, s, z, n)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k + 16, generator=g)[:, :k]  # rows 80 apart
    res = torch.randn(m, k, generator=g) if residual else None
    weight = torch.rand(k, generator=g) + 0.5
    y, r = gemm.rmsnorm(x, res, weight, 1e-5)
    want_r = x + res if residual else x
    assert torch.equal(r, want_r)
    want = gemm(torch.nn.functional.rms_norm(want_r, (k,), weight, 1e-5), torch.float32)
    assert (y - want).abs().max() <= 0.02 * want.abs().max()
    gate_up = torch.randn(m, 2 * k, generator=g) * 3
    want = gemm(torch.nn.functional.silu(gate_up[:, :k]) * gate_up[:, k:], torch.float32)
    got = gemm.silu_mul(gate_up)
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
    assert gemm.takes_rows(x, res, weight) and not gemm.takes_rows(x.bfloat16())


def test_gguf_linear_fuses_on_decode_rows_only() -> None:
    """GGUFLinear's rmsnorm_linear / silu_mul_linear: the fused call for fp32 rows under
    DENSE_MIN_TOKENS, giving what the norm / SwiGLU ops then the layer give; None (the
    caller's ops) for bf16 rows and for steps long enough for the de-quantized matmul."""
    from engine.models.layers import RMSNorm, silu_and_mul
    from engine.quant.int4_dense import DENSE_MIN_TOKENS
    from engine.quant.layers import GGUFLinear

    k, n = 64, 96
    layer = GGUFLinear(k, n, bias=False, activation_dtype=torch.bfloat16)  # as the loader
    w = unpack(Q.Q4_1, random_blocks(Q.Q4_1, n, k, seed=1), (n, k), "w")
    layer.weight.weight_loader(layer.weight, slice(0, n), w, "w")
    assert isinstance(layer.kernels[0], NibbleKernel)
    norm = RMSNorm(k, 1e-6)
    norm.weight.data = torch.rand(k) + 0.5
    g = torch.Generator().manual_seed(2)
    x, res = torch.randn(3, k, generator=g), torch.randn(3, k, generator=g)
    y, r = layer.rmsnorm_linear(x, res, norm)
    normed, want_r = norm(x, res)
    assert torch.equal(r, want_r)
    want = layer(normed)
    assert (y - want).abs().max() <= 0.02 * want.abs().max()
    gate_up = torch.randn(3, 2 * k, generator=g)
    want = layer(silu_and_mul(gate_up))
    assert (layer.silu_mul_linear(gate_up) - want).abs().max() <= 0.02 * want.abs().max()
    assert layer.rmsnorm_linear(x.bfloat16(), res.bfloat16(), norm) is None
    assert layer.silu_mul_linear(torch.zeros(DENSE_MIN_TOKENS, 2 * k)) is None


@pytest.mark.parametrize("fmt", [cpu_nibble.Q4, cpu_nibble.Q8], ids=["q4", "q8"])
def test_dequantized_transpose_and_rows_read_back(fmt: int) -> None:
    n, k = 48, 64
    codes, s, z = _packed(fmt, n, k, seed=7)
    rows = torch.arange(n)
    w = cpu_nibble.unpack_rows(fmt, codes, rows).float() * cpu_nibble.unpack_groups(
        s, rows).repeat_interleave(32, dim=1)
    if fmt == cpu_nibble.Q4:
        w += cpu_nibble.unpack_groups(z, rows).repeat_interleave(32, dim=1)
    assert torch.equal(cpu_nibble.dequant_t(fmt, codes, s, z, n, k), w.t().bfloat16())
    # the packing is a bijection: the unpacked codes pack back to the same bytes
    q = cpu_nibble.unpack_rows(fmt, codes, rows)
    repacked = cpu_nibble.pack_q4(q) if fmt == cpu_nibble.Q4 else cpu_nibble.pack_q8(q)
    assert torch.equal(repacked, codes)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("tokens", [1, 7, 256])  # 256: the de-quantized dense path
def test_nibble_kernel_matches_gguf_dequantization(qtype: GGMLQuantizationType,
                                                   tokens: int) -> None:
    rows, cols = 80, 256  # Q4_K: one super-block of 256 a row
    raw = random_blocks(qtype, rows, cols, seed=3)
    w = unpack(qtype, raw, (rows, cols), "w")
    kernel = NibbleKernel(w)
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(4))
    ref = reference_linear(x.bfloat16(), raw, qtype, (rows, cols))
    out = kernel(x)  # fp32 activations: rounded to bf16 on the way in, fp32 out
    assert out.dtype == torch.float32
    # fp16 scales (Q4_K's products rounded), bf16 W^T on the dense path
    tolerance = 1e-5 if tokens < 256 and qtype != Q.Q4_K else 5e-3
    assert (out - ref).abs().max() <= tolerance * ref.abs().max()
    if qtype == Q.Q8_0:
        ids = torch.tensor([0, 17, 79])
        assert kernel.codes_readable() and torch.equal(kernel.codes(ids), w.codes[ids])


@pytest.mark.parametrize("bf16_dot", [True, False])
def test_long_steps_densify_only_with_a_bf16_dot_product(bf16_dot: bool, monkeypatch) -> None:
    """From DENSE_MIN_TOKENS rows: the de-quantized W^T and a bf16 matmul where the CPU has a
    bf16 dot product; on AVX2 alone (torch's bf16 matmul several times slower) the kernel."""
    from engine.quant import kernels

    monkeypatch.setattr(kernels, "has_bf16_dot", lambda: bf16_dot)
    raw = random_blocks(Q.Q4_1, 32, 64, seed=5)
    kernel = NibbleKernel(unpack(Q.Q4_1, raw, (32, 64), "w"))
    made = []
    monkeypatch.setattr(kernel, "dense_t", lambda: made.append(1) or NibbleKernel.dense_t(kernel))
    x = torch.randn(kernels.DENSE_MIN_TOKENS, 64, generator=torch.Generator().manual_seed(6))
    out = kernel(x)
    assert bool(made) == bf16_dot
    if not bf16_dot:  # the GEMM's own bits
        assert torch.equal(out, kernel.gemm(x, torch.float32))


def test_shapes_it_does_not_take_are_refused() -> None:
    w = QuantWeight(Q.Q4_1, torch.zeros(24, 64, dtype=torch.int8), torch.ones(24, 2), None, 32)
    assert not NibbleKernel.fits(w)  # 24 rows: not whole tiles of 16
    with pytest.raises(ValueError, match="rows % 16"):
        NibbleKernel(w)


def test_the_build_is_cached_and_a_failed_build_raises(tmp_path: Path, monkeypatch) -> None:
    first = cpu_nibble.build(out_dir=tmp_path)
    stamp = first.stat().st_mtime_ns
    assert cpu_nibble.build(out_dir=tmp_path) == first and first.stat().st_mtime_ns == stamp
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    with pytest.raises(subprocess.CalledProcessError):
        cpu_nibble.build(source=bad, out_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, "bad.c"])  # no debris
    monkeypatch.setitem(os.environ, "CC", str(tmp_path / "no-such-compiler"))
    with pytest.raises(OSError):
        cpu_nibble.build(out_dir=tmp_path / "other")


@pytest.mark.parametrize("amx", [False, True])
def test_every_gguf_format_takes_the_kernel_wherever_it_runs(amx: bool, monkeypatch) -> None:
    """AMX or not (torch's AMX int4 GEMM only wins from 256 rows, where the de-quantized bf16
    matmul serves instead); `PDSERVE_CPU_NIBBLE=0` or no kernel here: torch's kernels."""
    monkeypatch.setattr(cpu_nibble, "_cpu_has", lambda probe: amx or "amx" not in probe)
    monkeypatch.delenv(cpu_nibble.CHOICE_ENV, raising=False)
    monkeypatch.setattr(cpu_nibble, "available", lambda: True)
    q4 = QuantWeight(Q.Q4_1, torch.zeros(32, 64, dtype=torch.int8), torch.ones(32, 2),
                     torch.zeros(32, 2), 32)
    q8 = QuantWeight(Q.Q8_0, torch.zeros(32, 64, dtype=torch.int8), torch.ones(32, 2), None, 32)
    assert cpu_nibble.preferred() and NibbleKernel.fits(q4) and NibbleKernel.fits(q8)
    monkeypatch.setattr(cpu_nibble, "available", lambda: False)  # no compiler, no AVX512-BF16
    assert not cpu_nibble.preferred() and not NibbleKernel.fits(q4) and not NibbleKernel.fits(q8)


@pytest.mark.parametrize("m", [1, 7])
def test_fp32_activations_are_rounded_as_torch_rounds_them(m: int) -> None:
    n, k = 48, 64
    codes, s, z = _packed(cpu_nibble.Q4, n, k, seed=11)
    x = torch.randn(m, 2 * k, generator=torch.Generator().manual_seed(12))[:, ::2]  # strided
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(12)) if m == 1 else x
    rounded = cpu_nibble.gemm(x.bfloat16(), cpu_nibble.Q4, codes, s, z, n, torch.float32)
    assert torch.equal(cpu_nibble.gemm(x, cpu_nibble.Q4, codes, s, z, n, torch.float32), rounded)
    wide = torch.randn(m, 4096 + 32)  # more than the kernel's stack scratch: the heap path
    codes, s, z = _packed(cpu_nibble.Q8, 16, wide.shape[1], seed=13)
    assert torch.equal(cpu_nibble.gemm(wide, cpu_nibble.Q8, codes, s, z, 16, torch.float32),
                       cpu_nibble.gemm(wide.bfloat16(), cpu_nibble.Q8, codes, s, z, 16,
                                       torch.float32))
