"""4-bit weights, 16-bit activations (engine/quant/w4a16*.py, kernels/w4a16.py): the Triton kernel
against its torch reference (Triton interpreter on the CPU, tiny shapes), the layer's
permutation, CPU int4 and fused-shard paths, tiny random Llamas written by the repository's own
quantizer in the AWQ, GPTQ and compressed-tensors pack-quantized formats giving the greedy
tokens of the same models with the de-quantized weights (fp32, CPU), detection from config.json,
and bad checkpoints named."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from quant_helpers import PROMPTS, SMALL, copy_model, greedy, random_w4a16_layout, rel_err
from safetensors.torch import load_file, save_file

from engine.llm import build_engine_config
from engine.quant.w4a16 import W4A16Weight, dequantize
from engine.quant.w4a16_checkpoint import iter_w4a16_weights
from engine.quant.w4a16_linear import W4A16Linear
from engine.quant.w4a16_quantize import (
    awq_tensors,
    compressed_tensors_tensors,
    gptq_tensors,
    quantize,
    write_checkpoint,
)
from kernels.w4a16 import GemmTile, dequantize_ref, pack_rows, unpack_rows, w4a16_linear, w4a16_ref
from kernels.w4a16_dequant import dequantize as dequantize_kernel
from kernels.w4a16_dequant import w4a16_dequant_linear
from kernels.w4a16_gemv import w4a16_gemv
from kernels.w4a16_planes import w4a16_planes_linear
from pdserve import LLM

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _random_weight(n: int, k: int, group: int, seed: int, **kwargs) -> W4A16Weight:
    gen = torch.Generator().manual_seed(seed)
    return quantize(torch.randn(n, k, generator=gen) * 0.1, group, **kwargs)


# ---- the kernel ----------------------------------------------------------------------------------
def test_pack_rows_round_trips() -> None:
    codes = torch.randint(0, 16, (24, 5), generator=torch.Generator().manual_seed(0))
    packed = pack_rows(codes)
    assert packed.shape == (3, 5) and packed.dtype == torch.int32
    assert torch.equal(unpack_rows(packed).long(), codes)
    assert pack_rows(torch.full((8, 1), 15)).item() == -1  # all 32 bits set


@pytest.mark.parametrize("mkn,group", [((1, 64, 48), 32), ((5, 128, 40), 64), ((17, 96, 72), 32),
                                       ((3, 64, 16), 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split_k", [1, 3])
def test_kernel_matches_the_reference(mkn, group: int, dtype: torch.dtype, split_k: int) -> None:
    m, k, n = mkn
    gen = torch.Generator().manual_seed(m * k + n)
    codes = torch.randint(0, 16, (k, n), generator=gen)
    scales = torch.rand(k // group, n, generator=gen) * 0.1 + 0.01
    zeros = torch.randint(0, 17, (k // group, n), generator=gen).to(torch.uint8)  # asymmetric
    x = torch.randn(m, k, generator=gen).to(dtype)
    args = [t.to(DEVICE) for t in (pack_rows(codes), scales, zeros)]
    out = w4a16_linear(x.to(DEVICE), *args, group, split_k=split_k)
    assert out.dtype == dtype and out.shape == (m, n)
    ref = w4a16_ref(x, pack_rows(codes), scales, zeros, group)
    assert rel_err(out.cpu(), ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("group_m", [1, 2, 8])
def test_grouped_tile_order_covers_every_tile_once(group_m: int) -> None:
    """5 x 3 output tiles of 16 x 16 (the last row and column tiles partial), taken in groups
    of GROUP_M row tiles: every output element written once, with its own tile's sum."""
    m, k, n, group = 70, 64, 40, 32
    layout = random_w4a16_layout(k, n, group, seed=group_m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    tile = GemmTile(16, 16, warps=1, stages=1, group_m=group_m)
    out = w4a16_linear(x.to(DEVICE), *[t.to(DEVICE) for t in layout], group, tile, split_k=1)
    assert rel_err(out.cpu(), w4a16_ref(x, *layout, group)) < 1e-5


@pytest.mark.parametrize("mkn", [(1, 256, 48), (5, 384, 72), (17, 128, 64), (40, 256, 130)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split_k", [1, 2, 3])
def test_nibble_plane_kernel_matches_the_reference(mkn, dtype: torch.dtype, split_k: int) -> None:
    """The sum over K taken plane by plane (nibble j of every int32 in one dot), zeros folded
    per group: the same product; partial row and column tiles, K shares of whole groups."""
    m, k, n = mkn
    layout = random_w4a16_layout(k, n, 128, seed=m + n + split_k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    out = w4a16_planes_linear(x.to(DEVICE), *[t.to(DEVICE) for t in layout], 128,
                              split_k=split_k)
    assert out.dtype == dtype and out.shape == (m, n)
    assert rel_err(out.cpu(), w4a16_ref(x, *layout, 128)) < TOLERANCE[dtype]
    with pytest.raises(ValueError, match="w4a16_planes_linear"):  # one group a 128-row step
        w4a16_planes_linear(x.to(DEVICE), *[t.to(DEVICE) for t in random_w4a16_layout(k, n, 64, 0)],
                            64)


@pytest.mark.parametrize("group", [32, 64, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_kernel_and_its_matmul(group: int, dtype: torch.dtype) -> None:
    """The prefill path: W written in x's dtype (the reference rounded once), then torch.mm."""
    k, n = 128, 200  # N not a multiple of the kernel's 128 columns
    layout = random_w4a16_layout(k, n, group, seed=group)
    w = dequantize_kernel(*[t.to(DEVICE) for t in layout], group, dtype)
    assert w.dtype == dtype and w.shape == (k, n)
    exact = dequantize_ref(*layout, group)  # fp32; one rounding to bf16 (the interpreter
    ulp = 0.0 if dtype == torch.float32 else 2.0**-7  # truncates: up to one unit of it)
    assert ((w.cpu().float() - exact).abs() <= ulp * exact.abs()).all()
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(2)).to(dtype)
    out = w4a16_dequant_linear(x.to(DEVICE), *[t.to(DEVICE) for t in layout], group)
    assert rel_err(out.cpu(), w4a16_ref(x, *layout, group)) < TOLERANCE[dtype]
    with pytest.raises(ValueError, match="w4a16_dequant_linear"):
        w4a16_dequant_linear(x[:, :64].to(DEVICE), *[t.to(DEVICE) for t in layout], group)


@pytest.mark.parametrize("mkn,group", [((1, 64, 48), 32), ((3, 128, 40), 64), ((4, 96, 72), 8),
                                       ((2, 64, 16), 64), ((1, 256, 24), 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split_k", [1, 2, 3])
@pytest.mark.parametrize("max_rows", [8, 2])  # steps of several groups, or within one
def test_gemv_kernel_matches_the_reference(mkn, group: int, dtype: torch.dtype, split_k: int,
                                           max_rows: int) -> None:
    m, k, n = mkn
    gen = torch.Generator().manual_seed(m * k + n + 1)
    codes = torch.randint(0, 16, (k, n), generator=gen)
    scales = torch.rand(k // group, n, generator=gen) * 0.1 + 0.01
    zeros = torch.randint(0, 17, (k // group, n), generator=gen).to(torch.uint8)
    x = torch.randn(m, k, generator=gen).to(dtype)
    args = [t.to(DEVICE) for t in (pack_rows(codes), scales, zeros)]
    out = w4a16_gemv(x.to(DEVICE), *args, group, blocks=(16, max_rows, 1), split_k=split_k)
    assert out.dtype == dtype and out.shape == (m, n)
    ref = w4a16_ref(x, pack_rows(codes), scales, zeros, group)
    assert rel_err(out.cpu(), ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("mkn,group", [((1, 64, 48), 32), ((2, 128, 40), 64),
                                       ((1, 256, 24), 256)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("max_rows,stages", [(8, 1), (2, 3)])
def test_gemv_codes_in_pairs_match_the_reference(mkn, group: int, dtype: torch.dtype,
                                                 split_k: int, max_rows: int, stages: int) -> None:
    """kernels/nibble_pairs.py: codes multiplied two at a time in fp16 (inline PTX on CUDA,
    its emulation in the interpreter), zeros up to 16, also pipelined, against the reference:
    the fp32 loop's error (the output's rounding) plus about fp16's unit (the lanes'
    roundings)."""
    m, k, n = mkn
    gen = torch.Generator().manual_seed(m * k + n + 7)
    codes = torch.randint(0, 16, (k, n), generator=gen)
    scales = torch.rand(k // group, n, generator=gen) * 0.1 + 0.01
    zeros = torch.randint(0, 17, (k // group, n), generator=gen).to(torch.uint8)
    x = (torch.randn(m, k, generator=gen) * 4).to(dtype)
    args = [t.to(DEVICE) for t in (pack_rows(codes), scales, zeros)]
    ref = w4a16_ref(x.float(), pack_rows(codes), scales, zeros, group)
    paired = w4a16_gemv(x.to(DEVICE), *args, group, (16, max_rows, 1), split_k, pairs=True,
                        stages=stages)
    fp32_loop = w4a16_gemv(x.to(DEVICE), *args, group, (16, max_rows, 1), split_k, pairs=False)
    assert paired.dtype == dtype and paired.shape == (m, n)
    assert rel_err(paired.cpu(), ref) < TOLERANCE[dtype]
    assert rel_err(paired.cpu(), ref) <= 1.5 * rel_err(fp32_loop.cpu(), ref) + 2.0**-10


@pytest.mark.parametrize("stages", [1, 3])
def test_gemv_codes_by_tma_equal_the_loaded_ones(stages: int) -> None:
    """`tma`: the codes' tiles by descriptor (zero-filled past N), the same sums as loaded."""
    k, n, group = 128, 40, 32
    gen = torch.Generator().manual_seed(3)
    codes = pack_rows(torch.randint(0, 16, (k, n), generator=gen))
    args = [t.to(DEVICE) for t in (codes, torch.rand(k // group, n, generator=gen) + 0.01,
                                   torch.randint(0, 16, (k // group, n), generator=gen)
                                   .to(torch.uint8))]
    x = torch.randn(1, k, generator=gen).to(torch.bfloat16).to(DEVICE)
    loaded = w4a16_gemv(x, *args, group, (16, 4, 1), 2, pairs=True)
    by_tma = w4a16_gemv(x, *args, group, (16, 4, 1), 2, pairs=True, tma=True, stages=stages)
    assert torch.equal(by_tma, loaded)
    rows_of_42 = torch.zeros(k // 8, 42, dtype=torch.int32, device=DEVICE)[:, :n]
    with pytest.raises(ValueError, match="tma needs"):  # rows 168 bytes apart
        w4a16_gemv(x, rows_of_42.copy_(args[0]), *args[1:], group, tma=True)


def test_gemv_pairs_need_16_bit_x() -> None:
    q, s, z = pack_rows(torch.zeros(64, 16, dtype=torch.int64)), torch.ones(2, 16), \
        torch.zeros(2, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="pairs needs bf16 or fp16"):
        w4a16_gemv(torch.randn(1, 64).to(DEVICE), q.to(DEVICE), s.to(DEVICE), z.to(DEVICE), 32,
                   pairs=True)


@pytest.mark.parametrize("symmetric", [True, False])
def test_kernel_on_act_order_weights_equals_the_dequantized_matmul(symmetric: bool) -> None:
    """Permuted groups: the layer packs W's rows in group order and gathers x's columns so."""
    w = _random_weight(48, 128, 32, seed=4, symmetric=symmetric, act_order=True)
    assert w.g_idx is not None
    layer = W4A16Linear(128, 48, bias=False)
    layer.weight.weight_loader(layer.weight, slice(None), w, "w")
    assert layer.perm is not None and not torch.equal(layer.perm, torch.arange(128))
    x = torch.randn(7, 128, generator=torch.Generator().manual_seed(5))
    expected = x @ dequantize(w).t()
    out = w4a16_linear(layer._gather(x).to(DEVICE), layer.qweight.to(DEVICE),
                       layer.scales.to(DEVICE), layer.zeros.to(DEVICE), 32, split_k=2)
    assert rel_err(out.cpu(), expected) < 1e-5
    out = w4a16_gemv(layer._gather(x[:3]).to(DEVICE), layer.qweight.to(DEVICE),
                     layer.scales.to(DEVICE), layer.zeros.to(DEVICE), 32)
    assert rel_err(out.cpu(), expected[:3]) < 1e-5
    assert torch.equal(layer(x), torch.nn.functional.linear(x, dequantize(w)))  # CPU: exact


def test_launcher_checks_its_inputs() -> None:
    q, s, z = pack_rows(torch.zeros(64, 16, dtype=torch.int64)), torch.ones(2, 16), \
        torch.zeros(2, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="need"):
        w4a16_linear(torch.randn(2, 64), q, s.half(), z, 32)
    with pytest.raises(ValueError, match="need"):
        w4a16_linear(torch.randn(2, 64), q, s, z, 8)  # a K step below 16
    with pytest.raises(ValueError, match="need"):
        w4a16_linear(torch.randn(2, 48), q, s, z, 32)


# ---- the formats' bit layouts, as their own packers write them ----------------------------------
def _pack_loop(values: torch.Tensor, order: list[int], along_rows: bool) -> torch.Tensor:
    """Eight 4-bit values per uint32, value `order[i]` of each eight into bits 4i (the packing
    loops of AutoAWQ's WQLinear_GEMM, AutoGPTQ's QuantLinear.pack, compressed-tensors'
    pack_to_int32), then viewed as int32."""
    v = values.numpy().astype(np.uint32)
    v = v.T if along_rows else v
    packed = np.zeros((v.shape[0], v.shape[1] // 8), dtype=np.uint32)
    for col in range(packed.shape[1]):
        for i in range(8):
            packed[:, col] |= v[:, col * 8 + order[i]] << (4 * i)
    packed = packed.T if along_rows else packed
    return torch.from_numpy(np.ascontiguousarray(packed).view(np.int32))


def test_writers_follow_each_formats_packing() -> None:
    w = _random_weight(24, 64, 32, seed=9, symmetric=False)
    awq = awq_tensors("x", w)
    awq_order = [0, 2, 4, 6, 1, 3, 5, 7]
    assert torch.equal(awq["x.qweight"], _pack_loop(w.codes, awq_order, along_rows=False))
    assert torch.equal(awq["x.qzeros"], _pack_loop(w.zeros, awq_order, along_rows=False))
    gptq = gptq_tensors("x", w)
    in_order = list(range(8))
    assert torch.equal(gptq["x.qweight"], _pack_loop(w.codes, in_order, along_rows=True))
    assert torch.equal(gptq["x.qzeros"], _pack_loop(w.zeros - 1, in_order, along_rows=False))
    ct = compressed_tensors_tensors("x", w)  # signed codes + 8: our unsigned codes
    assert torch.equal(ct["x.weight_packed"], _pack_loop(w.codes.t(), in_order, False))
    assert torch.equal(ct["x.weight_zero_point"], _pack_loop(w.zeros.t(), in_order, True))
    assert ct["x.weight_shape"].tolist() == [24, 64]
    symmetric = _random_weight(24, 64, 32, seed=9)
    assert (gptq_tensors("x", symmetric)["x.qzeros"] == 0x77777777).all()  # zero 8 stored as 7
    assert "x.weight_zero_point" not in compressed_tensors_tensors("x", symmetric)


# ---- the layer -----------------------------------------------------------------------------------
def test_fused_shards_pack_together_and_must_share_g_idx() -> None:
    q = _random_weight(32, 64, 32, seed=1, symmetric=False)
    k = _random_weight(16, 64, 32, seed=2, symmetric=False)
    layer = W4A16Linear(64, 48, bias=False)
    layer.weight.weight_loader(layer.weight, slice(32, 48), k, "k")  # any order
    assert layer.qweight is None
    layer.weight.weight_loader(layer.weight, slice(0, 32), q, "q")
    x = torch.randn(3, 64)
    expected = torch.cat([x @ dequantize(q).t(), x @ dequantize(k).t()], dim=1)
    torch.testing.assert_close(layer(x), expected)
    assert layer.weight_bytes() == 64 * 48 // 2 + 2 * 48 * 4 + 2 * 48
    a = _random_weight(32, 64, 32, seed=1, act_order=True)
    b = _random_weight(16, 64, 32, seed=3, act_order=True)
    layer = W4A16Linear(64, 48, bias=False)
    layer.weight.weight_loader(layer.weight, slice(0, 32), a, "model.qkv_proj.weight")
    with pytest.raises(ValueError, match="'model.qkv_proj.weight': fused shards with different "
                                         "g_idx"):
        layer.weight.weight_loader(layer.weight, slice(32, 48), b, "model.qkv_proj.weight")


def test_dense_or_misshapen_weights_are_named() -> None:
    layer = W4A16Linear(64, 32, bias=False)
    with pytest.raises(ValueError, match="'x.weight' is not 4-bit quantized"):
        layer.weight.weight_loader(layer.weight, slice(None), torch.randn(32, 64), "x.weight")
    with pytest.raises(ValueError, match=r"'x.weight' has shape \(32, 128\), expected \(32, 64\)"):
        layer.weight.weight_loader(layer.weight, slice(None), _random_weight(32, 128, 32, 0),
                                   "x.weight")
    w = _random_weight(32, 64, 32, 0, act_order=True)
    w.g_idx = torch.zeros(64, dtype=torch.int64)  # every row in group 0: not 32 per group
    with pytest.raises(ValueError, match="'x.weight': g_idx does not put 32 input rows"):
        layer.weight.weight_loader(layer.weight, slice(None), w, "x.weight")


@pytest.mark.parametrize("act_order", [False, True])
def test_cpu_bf16_layer_takes_torch_int4_kernel(act_order: bool) -> None:
    w = _random_weight(48, 128, 64, seed=6, symmetric=False, act_order=act_order)
    layer = W4A16Linear(128, 48, bias=True).to(torch.bfloat16)
    layer.bias.data.copy_(torch.randn(48))
    layer.weight.weight_loader(layer.weight, slice(None), w, "w")
    assert layer.int4pack is not None and layer.qweight is None
    x = torch.randn(5, 128).to(torch.bfloat16)
    expected = x.float() @ dequantize(w).t() + layer.bias.float()
    assert rel_err(layer(x), expected) < 1e-2


# ---- checkpoints, end to end ---------------------------------------------------------------------
CASES = [  # (format, group_size, symmetric, act_order)
    ("awq", 32, False, False),
    ("gptq", 32, True, True),  # desc_act: g_idx permuted; sym stores zero 8 as 7
    ("gptq", -1, False, False),  # one group per output channel
    ("compressed-tensors", 32, False, True),  # asymmetric, actorder "group"
    ("compressed-tensors", -1, True, False),  # strategy channel
]


@pytest.mark.parametrize("fmt,group,symmetric,act_order", CASES,
                         ids=["awq", "gptq-desc-act", "gptq-channel", "ct-asym-actorder",
                              "ct-channel"])
def test_checkpoint_equals_its_dequantized_model(
    tiny_llama_dir: str, tmp_path: Path, fmt: str, group: int, symmetric: bool, act_order: bool
) -> None:
    folder = tmp_path / fmt
    dequantized = write_checkpoint(tiny_llama_dir, folder, fmt, group, symmetric, act_order)
    llm = LLM(str(folder), **SMALL)  # the format detected from quantization_config
    assert llm.llm_engine.config.quantization == fmt
    layers = llm.llm_engine.runner.model.model.layers
    qkv, down = layers[0].self_attn.qkv_proj, layers[1].mlp.down_proj
    assert isinstance(qkv, W4A16Linear) and isinstance(down, W4A16Linear)
    assert (qkv.perm is not None) == act_order
    assert down.qweight.shape == (128 // 8, 64)  # [K / 8, N] int32: 4 bits a weight
    tokens = greedy(llm)
    assert len(set(map(tuple, tokens))) > 1
    del llm
    plain = LLM(copy_model(tiny_llama_dir, tmp_path / "dq", dequantized), **SMALL)
    assert greedy(plain) == tokens


def test_named_quantization_and_bad_requests(tiny_llama_dir: str, tmp_path: Path) -> None:
    folders = {fmt: str(tmp_path / fmt) for fmt in ("awq", "gptq", "compressed-tensors")}
    for fmt, folder in folders.items():
        write_checkpoint(tiny_llama_dir, folder, fmt)
        assert build_engine_config(folder, device="cpu").quantization == fmt
        assert build_engine_config(folder, device="cpu", quantization=fmt).quantization == fmt
        with pytest.raises(ValueError, match=f"quantization {fmt!r} runs on one rank for now"):
            build_engine_config(folder, device="cpu", tensor_parallel_size=2)
    bad = [((folders["awq"], "gptq"), "'gptq' cannot serve .* a awq"),
           ((folders["gptq"], "fp8"), "'fp8' cannot serve .* a gptq"),
           ((folders["compressed-tensors"], "none"), "'none' cannot serve"),
           ((tiny_llama_dir, "awq"), "'awq' needs a checkpoint in the awq format"),
           ((tiny_llama_dir, "compressed-tensors"), "needs a compressed-tensors")]
    for (model, quantization), match in bad:
        with pytest.raises(ValueError, match=match):
            build_engine_config(model, device="cpu", quantization=quantization)


BAD_CONFIGS = [
    ({"quant_method": "awq", "bits": 8, "group_size": 128, "version": "gemm"},
     r"quantization_config.bits 8 \(quant_method 'awq'\)"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
     r"quantization_config.version 'gemv' \(quant_method 'awq'\)"),
    ({"quant_method": "awq", "bits": 4}, r"quantization_config.group_size is missing"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, r"bits 3 \(quant_method 'gptq'\)"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     r"checkpoint_format 'marlin' \(quant_method 'gptq'\)"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 100}, r"group_size 100 \(quant_method"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "group_0": {"weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}},
     r"config_groups.group_0.weights: num_bits 8 type 'int' \(compressed-tensors"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "group_0": {"weights": {"num_bits": 4, "type": "int", "strategy": "tensor"}}}},
     r"group_0.weights.strategy 'tensor' \(compressed-tensors pack-quantized\)"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "group_0": {"weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                "group_size": 128},
                    "input_activations": {"num_bits": 8, "type": "int"}}}},
     r"group_0.input_activations \(compressed-tensors pack-quantized\)"),
]


@pytest.mark.parametrize("qc,match", BAD_CONFIGS, ids=[
    "awq-8bit", "awq-gemv", "awq-no-group", "gptq-3bit", "gptq-marlin", "gptq-group-100",
    "ct-8bit", "ct-tensor", "ct-w4a8"])
def test_unsupported_configs_name_the_field_and_format(
    tiny_llama_dir: str, tmp_path: Path, qc: dict, match: str
) -> None:
    config = json.loads((Path(tiny_llama_dir) / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    with pytest.raises(ValueError, match=match):
        build_engine_config(str(tmp_path), device="cpu")


def test_zero_biases_of_gptq_layers_are_dropped(tiny_llama_dir: str, tmp_path: Path) -> None:
    """AutoGPTQ writes a zero bias for every quantized layer of an unbiased model."""
    folder = tmp_path / "gptq"
    write_checkpoint(tiny_llama_dir, folder, "gptq")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.bias"] = torch.zeros(128)
    tensors["model.layers.0.mlp.down_proj.bias"] = torch.ones(64)  # not zero: kept, refused
    save_file(tensors, str(folder / "model.safetensors"))
    names = {name for name, _ in iter_w4a16_weights(str(folder), torch.float32)}
    assert "model.layers.0.mlp.up_proj.bias" not in names
    with pytest.raises(ValueError, match="unknown weight 'model.layers.0.mlp.down_proj.bias'"):
        LLM(str(folder), **SMALL)


PROJ = "model.layers.0.mlp.up_proj"
BAD_TENSORS = [  # (format, edit of the tensors, match)
    ("awq", lambda t: t.pop(f"{PROJ}.qzeros"), rf"'{PROJ}.qzeros' is missing \(awq format\)"),
    ("awq", lambda t: t.update({f"{PROJ}.scales": torch.ones(3, 128).half()}),
     rf"'{PROJ}.scales' \(awq format\) has shape \(3, 128\)"),
    ("gptq", lambda t: t.update({f"{PROJ}.qweight": t[f"{PROJ}.qweight"].float()}),
     rf"'{PROJ}.qweight' \(gptq format\) has shape \(8, 128\) torch.float32"),
    ("gptq", lambda t: t.update({f"{PROJ}.g_idx": torch.arange(32)}),
     rf"'{PROJ}.g_idx' has shape \(32,\)"),
    ("gptq", lambda t: t.update({"lm_head.qweight": t[f"{PROJ}.qweight"].clone()}),
     r"'lm_head.qweight' \(gptq format\): pdserve keeps only the attention and MLP"),
    ("gptq", lambda t: t.update({"model.norm.qzeros": t[f"{PROJ}.qzeros"].clone()}),
     r"tensors without a quantized weight .*model.norm.qzeros"),
    ("compressed-tensors", lambda t: t.update({f"{PROJ}.weight_shape": torch.tensor([128, 80])}),
     rf"'{PROJ}.weight_packed' \(compressed-tensors format\) has shape \(128, 8\)"),
    ("compressed-tensors", lambda t: t.update({f"{PROJ}.weight_zero_point": torch.zeros(3, 3)}),
     rf"'{PROJ}.weight_zero_point' \(compressed-tensors format\) has shape \(3, 3\)"),
]


@pytest.mark.parametrize("fmt,edit,match", BAD_TENSORS, ids=[
    "no-qzeros", "scales-shape", "float-qweight", "g_idx-shape", "lm_head", "orphan",
    "ct-shape", "ct-zero-point"])
def test_bad_tensors_name_the_tensor_and_format(
    tiny_llama_dir: str, tmp_path: Path, fmt: str, edit, match: str
) -> None:
    folder = tmp_path / fmt
    write_checkpoint(tiny_llama_dir, folder, fmt, 32, symmetric=False)
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=match):
        list(iter_w4a16_weights(str(folder), torch.float32))


@pytest.mark.skipif(not CUDA, reason="the W4A16 Triton kernel on a CUDA GPU")
def test_checkpoint_on_the_gpu_agrees_with_it_dequantized(tiny_llama_dir: str,
                                                          tmp_path: Path) -> None:
    gpu = dict(num_kv_blocks=64, max_model_len=128, device="cuda", dtype="bfloat16")
    dequantized = write_checkpoint(tiny_llama_dir, tmp_path / "awq", "awq", 32, False)
    layer = LLM(str(tmp_path / "awq"), **gpu).llm_engine.runner.model.model.layers[0]
    x = torch.randn(3, 64, device="cuda", dtype=torch.bfloat16)
    w = dequantized["model.layers.0.mlp.gate_proj.weight"].cuda()
    gate = layer.mlp.gate_up_proj(x)[:, :128]
    assert rel_err(gate, x.float() @ w.t()) < 1e-2


@pytest.mark.skipif(not CUDA, reason="the W4A16 layer's CUDA paths")
def test_one_token_decode_on_the_gpu_fuses_norms_and_swiglu(tiny_llama_dir: str, tmp_path: Path,
                                                             monkeypatch) -> None:
    """fp32 on CUDA, one sequence, `prologues` on: the decode steps take the GEMV with the norm
    or SwiGLU in its prologue (counted), and the greedy tokens are those of the de-quantized
    model."""
    fused = []
    monkeypatch.setattr(W4A16Linear, "prologues", True)
    for hook in ("rmsnorm_linear", "silu_mul_linear"):
        plain_hook = getattr(W4A16Linear, hook)

        def counted(self, *args, _hook=plain_hook, _name=hook):
            out = _hook(self, *args)
            fused.append(_name) if out is not None else None
            return out

        monkeypatch.setattr(W4A16Linear, hook, counted)
    gpu = dict(num_kv_blocks=64, max_model_len=128, device="cuda", dtype="float32")
    dequantized = write_checkpoint(tiny_llama_dir, tmp_path / "awq", "awq", 32, False)
    llm = LLM(str(tmp_path / "awq"), **gpu)
    tokens = greedy(llm, PROMPTS[:1], 16)
    assert {"rmsnorm_linear", "silu_mul_linear"} <= set(fused)
    del llm
    plain = LLM(copy_model(tiny_llama_dir, tmp_path / "dq", dequantized), **gpu)
    assert greedy(plain, PROMPTS[:1], 16) == tokens


@pytest.mark.skipif(not CUDA, reason="the W4A16 layer's CUDA paths")
@pytest.mark.parametrize("act_order", [False, True])
def test_the_layer_on_the_gpu_at_every_path(act_order: bool) -> None:
    """One token (the GEMV), a decode batch (the split-K GEMM) and a prefill-sized step (W
    de-quantized, then cuBLAS): each the de-quantized matmul, act-order permutation included."""
    from engine.quant.w4a16_linear import GEMM_MAX_TOKENS

    w = _random_weight(384, 256, 128, seed=7, symmetric=False, act_order=act_order)
    layer = W4A16Linear(256, 384, bias=False).to(device="cuda", dtype=torch.bfloat16)
    layer.weight.weight_loader(layer.weight, slice(None), w, "w")
    exact = dequantize(w).cuda()
    for m in (1, 24, GEMM_MAX_TOKENS + 36):
        x = torch.randn(m, 256, device="cuda", dtype=torch.bfloat16)
        assert rel_err(layer(x), x.float() @ exact.t()) < 1e-2, m


def test_gemv_shares_k_by_tile(monkeypatch) -> None:
    """The default K shares on a 132-SM GPU (the device is only named: no CUDA needed): the
    small tile's programs ~8 an SM, the large tile's at most 2 (H200 timings in
    kernels/w4a16_gemv.py)."""
    import types

    import kernels.w4a16 as w4a16
    from kernels.w4a16 import split_k_plan
    from kernels.w4a16_gemv import (
        LARGE_BLOCKS,
        SMALL_BLOCKS,
        default_blocks,
        gemv_rows,
        share_rule,
    )

    monkeypatch.setattr(w4a16, "sm_count", lambda device: 132)
    x = types.SimpleNamespace(device=torch.device("cuda", 0))

    def shares(k: int, n: int) -> int:
        blocks = default_blocks(k, n)
        step = 8 * gemv_rows(128, k, blocks[1])[0]  # group 128
        return split_k_plan(x, k, step, (1, n // blocks[0]), **share_rule(blocks)).split

    assert default_blocks(2048, 3072) == default_blocks(2048, 2048) == SMALL_BLOCKS
    assert default_blocks(2048, 16384) == default_blocks(8192, 2048) == LARGE_BLOCKS
    assert shares(2048, 3072) == 6 and shares(2048, 2048) == 8  # q/k/v 192, o 128 programs
    assert shares(2048, 16384) == 1  # gate_up: 256 programs of 4 steps stay whole
    assert shares(8192, 2048) == 8  # down: 32 programs of 16 steps
