"""GGUF kept quantized on CUDA (engine/quant/gguf_cuda.py): the 4-bit and 8-bit-codes Triton
GEMMs (kernels/gguf_q4.py, kernels/gguf_q8.py) against their torch references and gguf's own
de-quantization, under TRITON_INTERPRET=1 on the CPU (or on a GPU); the `quantization` rule on
CUDA; and, on a GPU only, a tiny Llama GGUF served kept quantized against it de-quantized,
with the weights held at about the file's size."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from test_quant_gguf import TINY_TYPES, random_blocks, write_quantized_llama

from engine.llm import build_engine_config
from engine.quant.blocks import QuantWeight, unpack
from engine.quant.gguf_cuda import Q4CudaKernel, Q8CudaKernel, make_cuda_kernel, pack_codes
from kernels.gguf_q4 import gguf_q4_linear, gguf_q4_ref
from kernels.gguf_q8 import gguf_q8_linear, gguf_q8_ref
from kernels.w4a16 import pack_rows
from pdserve import LLM, SamplingParams

Q = GGMLQuantizationType
CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the Triton kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)

FORMATS = (Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q8_0, Q.Q6_K)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # of max |reference|


def quant_weight(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int
                 ) -> tuple[QuantWeight, np.ndarray]:
    raw = random_blocks(qtype, rows, cols, seed)
    return unpack(qtype, raw, (rows, cols), "w"), raw


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    err = (out.float().cpu() - ref.float().cpu()).abs().max().item()
    assert err <= TOLERANCE[dtype] * ref.abs().max().item(), err


def test_pack_codes_is_w4a16_pack_rows_of_the_transpose() -> None:
    codes = torch.randint(0, 16, (24, 64), dtype=torch.int8)
    assert torch.equal(pack_codes(codes), pack_rows(codes.t()))


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 5, 19])
def test_kernel_equals_gguf_dequantized_matmul(qtype: GGMLQuantizationType,
                                               dtype: torch.dtype, m: int) -> None:
    """72 rows (a partial N tile), 512 columns (16 groups of 32, 32 of 16, several K steps)."""
    w, raw = quant_weight(qtype, 72, 512, seed=m)
    kernel = make_cuda_kernel(w, dtype, DEVICE)
    expected = torch.from_numpy(gguf_dequantize(raw, qtype).reshape(72, 512))
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
    ref = (x.to(dtype).float() @ expected.t()).to(dtype)
    _close(kernel(x.to(DEVICE, dtype)), ref, dtype)


@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_q4_kernel_matches_its_reference(dtype: torch.dtype, split_k: int) -> None:
    k, n, m = 256, 80, 3
    g = torch.Generator().manual_seed(split_k)
    qweight = pack_rows(torch.randint(0, 16, (k, n), generator=g))
    scales = (torch.rand(k // 32, n, generator=g) * 0.1).half()
    biases = (torch.randn(k // 32, n, generator=g) * 0.1).half()
    x = torch.randn(m, k, generator=g).to(dtype)
    args = [t.to(DEVICE) for t in (qweight, scales, biases)]
    out = gguf_q4_linear(x.to(DEVICE), *args, 32, split_k=split_k)
    _close(out, gguf_q4_ref(x, qweight, scales, biases, 32), dtype)


@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("split_k", [1, 2])
def test_q8_kernel_matches_its_reference(group: int, split_k: int) -> None:
    k, n, m = 192, 40, 7
    g = torch.Generator().manual_seed(group)
    codes = torch.randint(-128, 128, (k, n), generator=g, dtype=torch.int8)
    scales = torch.rand(k // group, n, generator=g) * 0.01
    x = torch.randn(m, k, generator=g)
    out = gguf_q8_linear(x.to(DEVICE), codes.to(DEVICE), scales.to(DEVICE), group,
                         split_k=split_k)
    _close(out, gguf_q8_ref(x, codes, scales, group), torch.float32)


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_embedding_rows_are_the_exact_dequantized_rows(qtype: GGMLQuantizationType) -> None:
    w, raw = quant_weight(qtype, 40, 256, seed=3)
    kernel = make_cuda_kernel(w, torch.float32, DEVICE)
    ids = torch.tensor([7, 0, 39, 7], device=DEVICE)
    expected = gguf_dequantize(raw, qtype).reshape(40, 256)[[7, 0, 39, 7]]
    rows = kernel.rows(ids, torch.float32)
    assert np.array_equal(rows.cpu().numpy(), expected)
    # row-major, as the embedding's consumers (the Triton RMSNorm) read it: a transposed view
    # here made the model's first norm read other elements on the GPU
    assert rows.is_contiguous() and kernel.rows(ids, torch.bfloat16).is_contiguous()


def test_scales_are_held_in_fp16_only_when_exact() -> None:
    """Bits a weight held: Q4_0 / Q4_1 5 (fp16 d, m), Q4_K 6 (fp32 d * sc), Q8_0 8.5, Q6_K 10."""
    bits = {}
    for qtype in FORMATS:
        kernel = make_cuda_kernel(quant_weight(qtype, 64, 256, seed=1)[0], torch.float32, DEVICE)
        bits[qtype] = kernel.nbytes() * 8 / (64 * 256)
    assert bits == {Q.Q4_0: 5.0, Q.Q4_1: 5.0, Q.Q4_K: 6.0, Q.Q8_0: 8.5, Q.Q6_K: 10.0}


def test_launchers_and_kernels_name_what_they_cannot_take() -> None:
    x = torch.randn(2, 64, device=DEVICE)
    q, s = torch.zeros(8, 16, dtype=torch.int32, device=DEVICE), torch.zeros(2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="biases"):
        gguf_q4_linear(x, q, s, s.half(), 32)  # scales and biases of two dtypes
    with pytest.raises(ValueError, match="group 64"):
        gguf_q4_linear(x, q, s[:1], s[:1], 64)
    with pytest.raises(ValueError, match="codes"):
        gguf_q8_linear(x, q, s, 32)  # int32 codes
    w = quant_weight(Q.Q8_0, 32, 64, seed=0)[0]
    with pytest.raises(ValueError, match="Q8_0"):
        Q4CudaKernel(w, DEVICE)
    w4 = quant_weight(Q.Q4_0, 32, 64, seed=0)[0]
    with pytest.raises(ValueError, match="Q4_0"):
        Q8CudaKernel(w4, DEVICE)


@pytest.fixture(scope="module")
def quantized_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qgguf-cuda") / "tiny-mixed.gguf"
    write_quantized_llama(path, TINY_TYPES)
    return path


def test_quantization_option_resolves_on_cuda(quantized_llama: Path, cache_root: Path) -> None:
    gguf = str(quantized_llama)
    cases = [  # (quantization, dtype) -> config.quantization on CUDA: kept quantized by name
        ((None, "auto"), None),
        ((None, "bfloat16"), None),
        ((None, "float32"), None),
        (("none", "auto"), None),
        (("gguf", "auto"), "gguf"),
        (("gguf", "float16"), "gguf"),
        (("gguf", "float32"), "gguf"),
    ]
    for (quantization, dtype), expected in cases:
        cfg = build_engine_config(gguf, dtype=dtype, device="cuda", quantization=quantization)
        assert cfg.quantization == expected, (quantization, dtype)
    cpu = build_engine_config(gguf, dtype="float16", device="cpu")
    assert cpu.quantization is None  # the CPU's int4 kernels take bf16


PROMPTS = [[5, 80, 77, 3], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110], [42],
           [7, 7, 7, 7, 7, 9]]


def _greedy(llm: LLM, max_tokens: int = 16, prompts: list[list[int]] = PROMPTS
            ) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture
def cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.skipif(CUDA, reason="the CUDA layers run on the CPU under the interpreter")
def test_tiny_model_through_the_cuda_layers_on_the_cpu_equals_it_dequantized(
    quantized_llama: Path, cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA layer classes (Triton GEMMs, lookups from the head's codes) built on the CPU and
    run under the interpreter: in fp32 the de-quantized model's greedy tokens exactly."""
    import engine.quant.layers as layers

    small = dict(num_kv_blocks=32, max_model_len=128, device="cpu", dtype="float32")
    prompts = PROMPTS[:2]
    expected = _greedy(LLM(str(quantized_llama), quantization="none", **small), 6, prompts)
    monkeypatch.setattr(layers, "uses_cuda_kernels", lambda weight: True)
    kept = LLM(str(quantized_llama), quantization="gguf", **small)
    model = kept.llm_engine.runner.model
    assert isinstance(model.model.layers[0].mlp.down_proj.kernels[0], (Q4CudaKernel, Q8CudaKernel))
    assert model.model.embed_tokens.table is None  # lookups read the head's codes
    assert _greedy(kept, 6, prompts) == expected
    assert _held_bytes(model) <= 1.3 * quantized_llama.stat().st_size


def _held_bytes(model: torch.nn.Module) -> int:
    """The GGUF layers' weights and the (fp32) norms."""
    from engine.quant.layers import GGUFEmbedding, GGUFLinear

    quantized = [m for m in model.modules() if isinstance(m, (GGUFLinear, GGUFEmbedding))]
    norms = sum(p.nbytes for n, p in model.named_parameters() if "norm" in n)
    return sum(m.weight_bytes() for m in quantized) + norms


# ---- on a GPU ------------------------------------------------------------------------------------
@pytest.mark.skipif(not CUDA, reason="the model on a CUDA GPU")
def test_tiny_model_on_the_gpu_kept_quantized_equals_it_dequantized(
    quantized_llama: Path, cache_root: Path
) -> None:
    """fp32: token for token the de-quantized model; bf16 (auto): most first tokens agree. The
    GGUF layers hold their weights at about the file's size (no de-quantized copy)."""
    from engine.quant.layers import GGUFLinear

    small = dict(num_kv_blocks=32, max_model_len=128, device="cuda", enforce_eager=True)
    expected = _greedy(LLM(str(quantized_llama), quantization="none", dtype="float32", **small))
    kept = LLM(str(quantized_llama), quantization="gguf", dtype="float32", **small)
    model = kept.llm_engine.runner.model
    assert isinstance(model.model.layers[0].mlp.down_proj, GGUFLinear)
    assert _greedy(kept) == expected
    assert len(set(map(tuple, expected))) > 1
    assert _held_bytes(model) <= 1.3 * quantized_llama.stat().st_size
    fast = LLM(str(quantized_llama), quantization="gguf", **small)  # dtype auto: bf16
    assert fast.llm_engine.config.quantization == "gguf"
    agree = sum(a[:4] == b[:4] for a, b in zip(_greedy(fast), expected))
    assert agree >= 3


@pytest.mark.skipif(not CUDA, reason="GPU memory")
def test_loading_a_layer_allocates_no_dequantized_copy_on_the_gpu() -> None:
    """A 4096 x 4096 Q4_1 layer (9.4 MiB in the file): the GPU's peak while loading is the
    packed layer itself (5 bits a weight), not 32 MiB of bf16."""
    from engine.quant.layers import GGUFLinear

    w, raw = quant_weight(Q.Q4_1, 4096, 4096, seed=0)
    layer = GGUFLinear(4096, 4096, bias=False).to("cuda", torch.bfloat16)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    layer.weight.weight_loader(layer.weight, slice(0, 4096), w, "w")
    peak = torch.cuda.max_memory_allocated() - base
    assert layer.weight_bytes() == raw.nbytes  # Q4_1: 20 bytes a block either way
    assert peak <= 1.3 * raw.nbytes
    x = torch.randn(3, 4096, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ torch.from_numpy(gguf_dequantize(raw, Q.Q4_1)).cuda().t()
    _close(layer(x), ref, torch.bfloat16)
