"""FP8 (engine/quant/fp8.py): the kernels against their torch references (Triton interpreter on
the CPU, tiny shapes), tiny random models quantized on load against the same models quantized
then de-quantized by the repository's own quantizer (identical greedy tokens in fp32 on the
CPU) and close to the unquantized ones, FP8 checkpoints in the vLLM/HF `fp8` and
compressed-tensors formats giving the same tokens, and bad checkpoints named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from quant_helpers import SMALL, copy_model, greedy, rel_err
from safetensors.torch import load_file, save_file

from engine.llm import build_engine_config
from engine.model_loader import iter_model_weights
from engine.quant.fp8 import W8A16_MAX_TOKENS, Fp8Linear, Fp8Weight, dequantize, quantize_weight
from kernels.fp8 import (
    FP8,
    quantize_rows_ref,
    scaled_mm,
    scaled_mm_ref,
    scaled_mm_supported,
    w8a16_ref,
)
from kernels.fp8_gemv import fp8_gemv
from kernels.fp8_quant import quantize_rows
from kernels.fp8_w8a16 import w8a16_linear
from pdserve import LLM, SamplingParams

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# relative error of a GEMM against its reference: fp32 exact up to summation order; bf16 rounds
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


# ---- kernels -------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 16), (3, 80), (5, 200)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_equals_the_reference(shape: tuple[int, int], dtype: torch.dtype) -> None:
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    x[0, :] = 0 if shape[0] > 2 else x[0, :]  # an all-zero row keeps the floor scale
    q, scale = quantize_rows(x.to(DEVICE))
    q_ref, scale_ref = quantize_rows_ref(x)
    assert q.dtype == FP8 and scale.shape == (shape[0], 1)
    torch.testing.assert_close(scale.cpu(), scale_ref, rtol=1e-6, atol=0)
    assert torch.equal(q.cpu().float(), q_ref.float())
    assert rel_err(q_ref.float() * scale_ref, x.float()) < 0.05  # fp8 keeps ~3 bits of mantissa


@pytest.mark.parametrize("mkn", [(1, 64, 48), (5, 96, 80), (17, 200, 33), (70, 64, 130)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a16_kernel_matches_the_reference(mkn: tuple[int, int, int], dtype: torch.dtype) -> None:
    m, k, n = mkn
    gen = torch.Generator().manual_seed(m + k + n)
    w = quantize_weight(torch.randn(n, k, generator=gen) * 0.1)
    x = torch.randn(m, k, generator=gen).to(dtype)
    out = w8a16_linear(x.to(DEVICE), w.qweight.to(DEVICE), w.scale.to(DEVICE))
    assert out.dtype == dtype and out.shape == (m, n)
    assert rel_err(out.cpu(), w8a16_ref(x, w.qweight, w.scale)) < TOLERANCE[dtype]


def test_w8a16_launcher_checks_its_inputs() -> None:
    w = quantize_weight(torch.randn(8, 16))
    with pytest.raises(ValueError, match="fp8"):
        w8a16_linear(torch.randn(2, 16), w.qweight.float(), w.scale)
    with pytest.raises(ValueError, match="need"):
        w8a16_linear(torch.randn(2, 12), w.qweight, w.scale)


def test_quantizer_is_per_channel_and_exact_for_a_zero_row() -> None:
    w = torch.randn(6, 32, generator=torch.Generator().manual_seed(3)) * torch.arange(1, 7)[:, None]
    w[2] = 0
    fp8 = quantize_weight(w)
    assert fp8.qweight.dtype == FP8 and fp8.scale.shape == (6,)
    assert fp8.qweight.float().abs().amax(dim=1)[[0, 1, 3, 4, 5]].eq(448).all()
    assert torch.equal(dequantize(fp8)[2], torch.zeros(32))
    assert rel_err(dequantize(fp8), w) < 0.05


@pytest.mark.skipif(not CUDA, reason="torch._scaled_mm needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 12, 64, 256])  # the GEMV, W8A16, then _scaled_mm
def test_scaled_mm_and_the_layer_match_the_reference_on_the_gpu(m: int) -> None:
    if not scaled_mm_supported(torch.device("cuda"), 256, 512):
        pytest.skip("no fp8 tensor cores (compute capability < 8.9)")
    w = quantize_weight(torch.randn(512, 256, device="cuda") * 0.05)
    x = torch.randn(m, 256, device="cuda", dtype=torch.bfloat16)
    xq, xs = quantize_rows(x)
    out = scaled_mm(xq, xs, w.qweight, w.scale.view(1, -1))
    assert rel_err(out, scaled_mm_ref(xq, xs, w.qweight, w.scale, torch.bfloat16)) < 1e-2
    layer = Fp8Linear(256, 512, bias=False).to(device="cuda", dtype=torch.bfloat16)
    layer.weight.weight_loader(layer.weight, slice(None), w, "w")
    assert layer.use_scaled_mm
    exact = x.float() @ dequantize(w).t()
    # activations in fp8 too from 17 tokens; up to 16 the W8A16 GEMM keeps them in bf16
    assert rel_err(layer(x), exact) < (1e-2 if m <= W8A16_MAX_TOKENS else 0.06)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [17, 64, 256])
def test_the_triton_fp8_gemm_serves_the_layer_like_scaled_mm(
        m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """`Fp8Linear.triton_gemm` (gpu_quant's fp8_triton): the quantized rows' product by
    kernels/fp8_gemm.py, the same as torch._scaled_mm's up to the fp32 sums' order."""
    if not scaled_mm_supported(torch.device("cuda"), 2048, 8192):
        pytest.skip("no fp8 tensor cores (compute capability < 8.9)")
    w = quantize_weight(torch.randn(2048, 8192, device="cuda") * 0.02)  # down_proj's shape
    layer = Fp8Linear(8192, 2048, bias=False).to(device="cuda", dtype=torch.bfloat16)
    layer.weight.weight_loader(layer.weight, slice(None), w, "w")
    x = torch.randn(m, 8192, device="cuda", dtype=torch.bfloat16)
    want = layer(x)
    monkeypatch.setattr(Fp8Linear, "triton_gemm", True)
    assert rel_err(layer(x), want) < 1e-2
    assert rel_err(layer.forward_fp8(*quantize_rows(x)), want) < 1e-2


def test_fp8_rows_are_taken_where_the_layer_would_quantize_them_itself() -> None:
    """`takes_fp8_rows` (engine/models/fp8_inputs.py asks it): CUDA, torch._scaled_mm, bf16
    rows, no static input scale, more than W8A16_MAX_TOKENS tokens; never on the CPU."""
    layer = Fp8Linear(32, 48, bias=False)
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    assert not layer.takes_fp8_rows(64, cuda, bf16)  # no torch._scaled_mm here
    layer.use_scaled_mm = True
    assert layer.takes_fp8_rows(W8A16_MAX_TOKENS + 1, cuda, bf16)
    assert not layer.takes_fp8_rows(W8A16_MAX_TOKENS, cuda, bf16)
    assert not layer.takes_fp8_rows(64, torch.device("cpu"), bf16)
    assert not layer.takes_fp8_rows(64, cuda, torch.float16)
    layer.input_scale = torch.tensor(0.5)
    assert not layer.takes_fp8_rows(64, cuda, bf16)


# ---- checkpoints ---------------------------------------------------------------------------------
def _proj(name: str) -> bool:
    return name.endswith("_proj.weight")


def _weights(src: str) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(Path(src).glob("*.safetensors")) for k, v in load_file(f).items()}


def write_dequantized(src: str, dst: Path) -> str:
    """The unquantized checkpoint with every projection quantized then de-quantized (fp32)."""
    tensors = {k: dequantize(quantize_weight(v)) if _proj(k) else v
               for k, v in _weights(src).items()}
    return copy_model(src, dst, tensors)


def write_fp8(src: str, dst: Path, fmt: str, per_tensor: bool = False) -> str:
    """An FP8 checkpoint of `src`: vLLM/HF "fp8" (weight_scale [out], or [] per tensor with a
    static input_scale) or compressed-tensors FP8_DYNAMIC (weight_scale [out, 1])."""
    tensors = {}
    for name, w in _weights(src).items():
        if not _proj(name):
            tensors[name] = w
            continue
        if per_tensor:
            scale = w.abs().amax() / 448  # [] : one scale for the tensor
            tensors[name] = (w / scale).clamp(-448, 448).to(FP8)
            tensors[f"{name[:-7]}.input_scale"] = torch.tensor(0.02)
        else:
            fp8 = quantize_weight(w)
            tensors[name] = fp8.qweight
            scale = fp8.scale[:, None] if fmt == "compressed-tensors" else fp8.scale
        tensors[f"{name}_scale"] = scale
    return copy_model(src, dst, tensors, FP8_CONFIGS[fmt] if not per_tensor else
                      {"quant_method": "fp8", "activation_scheme": "static"})


FP8_CONFIGS = {
    "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": ["lm_head"]},
    "compressed-tensors": {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "ignore": ["lm_head"], "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                        "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                  "symmetric": True, "dynamic": True},
        }},
    },
}


def _prompt_logprobs(llm: LLM, prompt: list[int]) -> torch.Tensor:
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    return torch.tensor([step[t].logprob for t, step in zip(prompt[1:], out.prompt_logprobs[1:])])


def test_quantized_on_load_equals_it_dequantized_and_the_fp8_checkpoints(
    tiny_llama_dir: str, tmp_path: Path
) -> None:
    fp8 = LLM(tiny_llama_dir, quantization="fp8", **SMALL)
    assert fp8.llm_engine.config.quantization == "fp8"
    down = fp8.llm_engine.runner.model.model.layers[0].mlp.down_proj
    assert isinstance(down, Fp8Linear) and down.qweight.dtype == FP8
    assert down.weight_bytes() == 64 * 128 + 4 * 64  # fp8 values and fp32 scales, no copy
    tokens = greedy(fp8)
    assert len(set(map(tuple, tokens))) > 1  # the prompts do not all collapse to one output
    prompt = list(range(10, 40))
    quantized_logprobs = _prompt_logprobs(fp8, prompt)
    del fp8
    assert greedy(LLM(write_dequantized(tiny_llama_dir, tmp_path / "dq"), **SMALL)) == tokens
    plain = _prompt_logprobs(LLM(tiny_llama_dir, **SMALL), prompt)
    # fp8 rounds each weight by up to 1/16 (about 2% on average): logprobs move by a few %
    diff = (quantized_logprobs - plain).abs()
    assert diff.mean() < 0.25 and (diff / plain.abs()).max() < 0.06
    for fmt in ("fp8", "compressed-tensors"):
        folder = write_fp8(tiny_llama_dir, tmp_path / fmt, fmt)
        llm = LLM(folder, **SMALL)  # the format detected from quantization_config
        assert llm.llm_engine.config.quantization == "fp8", fmt
        assert greedy(llm) == tokens, fmt


def test_per_tensor_static_checkpoint_of_qwen2_equals_it_dequantized(
    tiny_qwen2_dir: str, tmp_path: Path
) -> None:
    """Per-tensor scales spread over the rows (exact); biases and an untied lm_head stay."""
    folder = write_fp8(tiny_qwen2_dir, tmp_path / "fp8", "fp8", per_tensor=True)
    llm = LLM(folder, **SMALL)
    qkv = llm.llm_engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.input_scale is not None and qkv.bias is not None
    weights = dict(iter_model_weights(folder, torch.float32, "fp8", None))
    tensors = {k: dequantize(v) if isinstance(v, Fp8Weight) else v for k, v in weights.items()}
    dq = copy_model(tiny_qwen2_dir, tmp_path / "dq", tensors)
    assert greedy(llm) == greedy(LLM(dq, **SMALL))


# ---- options and bad checkpoints -----------------------------------------------------------------
def test_quantization_option_resolves(tiny_llama_dir: str, tmp_path: Path) -> None:
    ct = write_fp8(tiny_llama_dir, tmp_path / "ct", "compressed-tensors")
    cases = [((tiny_llama_dir, None), None), ((tiny_llama_dir, "fp8"), "fp8"),
             ((ct, None), "fp8"), ((ct, "fp8"), "fp8"), ((ct, "compressed-tensors"), "fp8")]
    for (model, quantization), expected in cases:
        cfg = build_engine_config(model, device="cpu", quantization=quantization)
        assert cfg.quantization == expected, (model, quantization)
    bad = [((tiny_llama_dir, "compressed-tensors", 1), "needs a compressed-tensors"),
           ((ct, "none", 1), "GGUF files only"), ((ct, "gguf", 1), "needs a .gguf"),
           ((tiny_llama_dir, "fp8", 2), "one rank"),
           ((ct, "awq", 1), "'awq' needs a checkpoint in the awq format")]
    for (model, quantization, tp), match in bad:
        with pytest.raises(ValueError, match=match):
            build_engine_config(model, device="cpu", quantization=quantization,
                                tensor_parallel_size=tp)


BAD_CONFIGS = [
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, r"weight_block_size.*fp8 format"),
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
    ({**FP8_CONFIGS["compressed-tensors"], "config_groups": {"group_0": {
        "weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}},
     r"config_groups.group_0.weights: num_bits 4 type 'int' \(compressed-tensors\)"),
    ({**FP8_CONFIGS["compressed-tensors"], "config_groups": {"group_0": {
        "weights": {"num_bits": 8, "type": "float", "strategy": "block"}}}},
     r"weights.strategy 'block' \(compressed-tensors\)"),
]


@pytest.mark.parametrize("qc,match", BAD_CONFIGS, ids=["block", "awq", "w4", "ct-block"])
def test_unsupported_configs_name_the_field_and_format(
    tiny_llama_dir: str, tmp_path: Path, qc: dict, match: str
) -> None:
    config = json.loads((Path(tiny_llama_dir) / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    with pytest.raises(ValueError, match=match):
        build_engine_config(str(tmp_path), device="cpu")


def _bad_tensors(tensors: dict[str, torch.Tensor], case: str) -> None:
    name = "model.layers.0.mlp.up_proj.weight"
    if case == "no-scale":
        del tensors[f"{name}_scale"]
    elif case == "block-scale":
        tensors[f"{name}_scale"] = torch.ones(2, 2)
    elif case == "fp8-embedding":
        tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].to(FP8)
    elif case == "orphan-scale":
        tensors["model.norm.weight_scale"] = torch.ones(1)


@pytest.mark.parametrize("case,match", [
    ("no-scale", r"'model.layers.0.mlp.up_proj.weight' has no .*weight_scale.*\(fp8 format\)"),
    ("block-scale", r"'model.layers.0.mlp.up_proj.weight_scale' \(fp8 format\) has shape \(2, 2\)"),
    ("fp8-embedding", r"'model.embed_tokens.weight' is float8_e4m3fn \(fp8 format\)"),
    ("orphan-scale", r"scales without an FP8 weight .*model.norm.weight_scale"),
])
def test_bad_fp8_tensors_name_the_tensor_and_format(
    tiny_llama_dir: str, tmp_path: Path, case: str, match: str
) -> None:
    folder = Path(write_fp8(tiny_llama_dir, tmp_path / "fp8", "fp8"))
    tensors = load_file(folder / "model.safetensors")
    _bad_tensors(tensors, case)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=match):
        list(iter_model_weights(str(folder), torch.float32, "fp8", None))


@pytest.mark.skipif(not CUDA, reason="the FP8 GEMMs of a CUDA GPU")
def test_fp8_on_the_gpu_agrees_with_it_dequantized(cuda_llama_dir: str, tmp_path: Path) -> None:
    """bf16 on the GPU (GEMV for steps of <= 4 tokens, per-token fp8 activations and
    _scaled_mm above): logprobs close to the de-quantized model's. Not greedy tokens: this
    random model's first tokens flip even between bf16 and fp32 of the same weights (2 of 4
    prompts); where the H100's fp8 tokens differed from the de-quantized model's, a CPU
    emulation of the same arithmetic (quantize_rows_ref + scaled_mm_ref) gave them too."""
    gpu = dict(num_kv_blocks=64, max_model_len=128, device="cuda", dtype="bfloat16")
    prompt = list(range(10, 60))
    fp8 = LLM(cuda_llama_dir, quantization="fp8", **gpu)
    down = fp8.llm_engine.runner.model.model.layers[0].mlp.down_proj
    assert isinstance(down, Fp8Linear) and down.qweight.is_cuda
    logprobs = _prompt_logprobs(fp8, prompt)
    del fp8
    dq = LLM(write_dequantized(cuda_llama_dir, tmp_path / "dq"), **gpu)
    expected = _prompt_logprobs(dq, prompt)
    diff = (logprobs - expected).abs()
    assert (diff / expected.abs()).mean() < 0.05, (diff, expected)


@pytest.mark.skipif(not CUDA, reason="torch._scaled_mm needs a CUDA GPU")
def test_fp8_rows_quantized_by_the_norm_and_swiglu_give_the_same_logits(
    cuda_llama_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 64-token prefill: qkv_proj, gate_up_proj and down_proj take rows quantized by the
    kernel before them (engine/models/fp8_inputs.py), only o_proj calls quantize_rows; the
    logits are those of quantize_rows before every projection, bit for bit."""
    if not scaled_mm_supported(torch.device("cuda"), 576, 960):
        pytest.skip("no fp8 tensor cores (compute capability < 8.9)")
    import kernels.fp8_quant

    llm = LLM(cuda_llama_dir, quantization="fp8", num_kv_blocks=64, max_model_len=128,
              device="cuda", dtype="bfloat16", enforce_eager=True, enable_prefix_caching=False,
              async_scheduling=False)  # one eager forward of the whole prompt a call
    model = llm.llm_engine.runner.model
    calls: list[int] = []
    quantize = kernels.fp8_quant.quantize_rows
    monkeypatch.setattr(kernels.fp8_quant, "quantize_rows",
                        lambda x: calls.append(x.shape[0]) or quantize(x))
    prompt = list(range(10, 74))
    monkeypatch.setattr(Fp8Linear, "fused_inputs", True)  # the default
    fused = _prefill_logits(llm, prompt)
    fused_calls, calls[:] = list(calls), []
    monkeypatch.setattr(Fp8Linear, "fused_inputs", False)  # gpu_quant's fp8_unfused
    unfused = _prefill_logits(llm, prompt)
    layers = len(model.model.layers)
    assert fused_calls == [64] * layers and calls == [64] * (4 * layers)
    assert torch.equal(fused, unfused)


def _prefill_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), V] logits of the prompt's one prefill step (a hook on the decoder)."""
    model, hidden = llm.llm_engine.runner.model, []
    handle = model.model.register_forward_hook(lambda _m, _a, out: hidden.append(out.clone()))
    try:
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1),
                     use_tqdm=False)
    finally:
        handle.remove()
    assert [h.shape[0] for h in hidden] == [len(prompt)]
    with torch.inference_mode():  # the hidden states are inference tensors
        return model.compute_logits(hidden[0])


@pytest.mark.parametrize("mkn,blocks", [((1, 64, 48), None), ((3, 200, 33), None),
                                        ((4, 96, 80), (8, 32)), ((2, 1030, 20), (4, 256))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_kernel_matches_the_reference(mkn: tuple[int, int, int], blocks, dtype) -> None:
    m, k, n = mkn
    gen = torch.Generator().manual_seed(m * k + n)
    w = quantize_weight(torch.randn(n, k, generator=gen) * 0.1)
    x = torch.randn(m, k, generator=gen).to(dtype)
    out = fp8_gemv(x.to(DEVICE), w.qweight.to(DEVICE), w.scale.to(DEVICE), blocks)
    assert out.dtype == dtype and out.shape == (m, n)
    assert rel_err(out.cpu(), w8a16_ref(x, w.qweight, w.scale)) < TOLERANCE[dtype]
