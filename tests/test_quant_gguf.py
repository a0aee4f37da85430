"""GGUF kept quantized (engine/quant/): each block format against gguf's own de-quantization,
each kernel against its reference within the format's tolerance, a tiny random Llama GGUF
kept quantized against the same file de-quantized (identical greedy tokens in fp32), the
bundled model against HF transformers, and the `quantization` option from the API and flags."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest
import torch
from _model_helpers import _gpt2_byte_chars, write_tiny_gguf
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize

from engine.config import EngineConfig
from engine.llm import build_engine_config
from engine.model_loader import iter_weights
from engine.quant.blocks import unpack
from engine.quant.gguf_weights import iter_gguf_weights
from engine.quant.kernels import (
    DequantKernel,
    Int4PackKernel,
    NibbleKernel,
    SplitInt8Kernel,
    make_kernel,
    reference_linear,
)
from engine.quant.layers import GGUFEmbedding, GGUFLinear
from kernels import cpu_nibble
from pdserve import LLM, SamplingParams

Q = GGMLQuantizationType
FORMATS = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K]
# fp32 kernels de-quantize exactly; bf16 ones round activations, scales and outputs to bf16
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # of max |reference|


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int) -> np.ndarray:
    """[rows, bytes per row] of `qtype` for random weights of std ~0.1: gguf's quantizer where
    it has one, else random bytes with small fp16 super-block scales (Q4_K, Q6_K)."""
    rng = np.random.default_rng(seed)
    if qtype not in (Q.Q4_K, Q.Q6_K):
        return quantize((rng.standard_normal((rows, cols)) * 0.1).astype(np.float32), qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    if qtype == Q.Q4_K:  # d, dmin: w = d * sc * q - dmin * m, sc and m 6-bit, q 4-bit
        raw[:, 0:4] = np.array([[0.0006, 0.002]], np.float16).view(np.uint8)
    else:  # Q6_K's d: w = d * sc * (q - 32), sc int8
        raw[:, 208:210] = np.array([[0.00005]], np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_unpacked_blocks_equal_gguf_dequantize_bit_for_bit(qtype: GGMLQuantizationType) -> None:
    raw = random_blocks(qtype, 6, 512, seed=1)
    w = unpack(qtype, raw, (6, 512), "blk.0.ffn_up.weight")
    expected = gguf_dequantize(raw, qtype)
    from engine.quant.blocks import dequantize

    assert np.array_equal(dequantize(w).numpy(), expected)
    assert np.array_equal(dequantize(w.rows(torch.tensor([4, 1]))).numpy(), expected[[4, 1]])


KERNELS = {  # (format, activation dtype) -> the kernel make_kernel picks without cpu_nibble
    **{(t, torch.float32): DequantKernel for t in FORMATS},
    (Q.Q4_0, torch.bfloat16): Int4PackKernel,
    (Q.Q4_1, torch.bfloat16): Int4PackKernel,
    (Q.Q4_K, torch.bfloat16): Int4PackKernel,
    (Q.Q8_0, torch.bfloat16): SplitInt8Kernel,
    (Q.Q6_K, torch.bfloat16): DequantKernel,
}
NIBBLE_FORMATS = (Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q8_0)  # bf16 with AVX512-BF16: kernels/cpu_nibble


@pytest.mark.parametrize("nibble", [True, False], ids=["nibble", "torch_int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("tokens", [1, 7])
def test_kernels_match_the_reference(
    qtype: GGMLQuantizationType, dtype: torch.dtype, tokens: int, nibble: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if nibble and not cpu_nibble.available():
        pytest.skip("kernels/cpu_nibble.c does not run here (no AVX512-BF16 or no C compiler)")
    monkeypatch.setattr(cpu_nibble, "preferred", lambda: nibble)
    rows, cols = 1104, 256  # more rows than one de-quantized tile (1024 at 256 columns)
    raw = random_blocks(qtype, rows, cols, seed=2)
    kernel = make_kernel(unpack(qtype, raw, (rows, cols), "w"), dtype)
    nibble_picked = nibble and dtype == torch.bfloat16 and qtype in NIBBLE_FORMATS
    assert type(kernel) is (NibbleKernel if nibble_picked else KERNELS[qtype, dtype])
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(3))
    out = kernel(x.to(dtype))
    ref = reference_linear(x.to(dtype), raw, qtype, (rows, cols))
    assert out.dtype == dtype and out.shape == (tokens, rows)
    err = (out.float() - ref).abs().max().item()
    assert err <= TOLERANCE[dtype] * ref.abs().max().item(), err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_linear_of_mixed_formats_and_bias(dtype: torch.dtype) -> None:
    """q/k/v of three formats arrive as row ranges, in any order; adjacent ones of one format
    share a kernel; the bias is added once."""
    cols, parts = 256, [(Q.Q4_K, 64), (Q.Q4_K, 32), (Q.Q6_K, 32), (Q.Q8_0, 16)]
    layer = GGUFLinear(cols, 144, bias=True).to(dtype)
    layer.bias.data.copy_(torch.linspace(-1, 1, 144))
    raws, start = [], 0
    for i, (qtype, n) in enumerate(parts):
        raws.append((qtype, raw := random_blocks(qtype, n, cols, seed=10 + i), start))
        start += n
    for qtype, raw, start in reversed(raws):
        assert not layer.kernels
        rows = slice(start, start + raw.shape[0])
        layer.weight.weight_loader(
            layer.weight, rows, unpack(qtype, raw, raw.shape[:1] + (cols,), "w"), "w"
        )
    assert len(layer.kernels) == 3  # the two Q4_K parts merged
    x = torch.randn(5, cols)
    ref = (
        torch.cat(
            [
                reference_linear(x.to(dtype), raw, qtype, (raw.shape[0], cols))
                for qtype, raw, _ in raws
            ],
            dim=-1,
        )
        + layer.bias.float()
    )
    err = (layer(x.to(dtype)).float() - ref).abs().max().item()
    assert err <= TOLERANCE[dtype] * ref.abs().max().item()


def test_wrong_shape_and_unsupported_type_name_the_tensor() -> None:
    layer = GGUFLinear(256, 64, bias=False)
    raw = random_blocks(Q.Q8_0, 32, 256, seed=0)
    with pytest.raises(ValueError, match="blk.3.attn_q.weight.*shape"):
        layer.weight.weight_loader(
            layer.weight, slice(0, 64), unpack(Q.Q8_0, raw, (32, 256), "w"), "blk.3.attn_q.weight"
        )
    with pytest.raises(ValueError, match=r"'blk.0.ffn_up.weight'.*Q5_K"):
        unpack(Q.Q5_K, np.zeros((4, 176), np.uint8), (4, 256), "blk.0.ffn_up.weight")
    embedding = GGUFEmbedding(10, 32)
    with pytest.raises(ValueError, match="token_embd"):
        embedding.weight.weight_loader(
            embedding.weight, slice(None), torch.zeros(9, 32), "token_embd.weight"
        )


@pytest.mark.parametrize(
    "dtype, activations",
    [(torch.float32, None), (torch.bfloat16, None), (torch.float32, torch.bfloat16)],
    ids=["fp32", "bf16", "fp32-bf16-kernels"],
)
def test_quantized_embedding_gathers_exact_rows_and_its_logits_read_the_table(
    dtype: torch.dtype, activations: torch.dtype | None
) -> None:
    vocab = 320  # whole blocks of 64 rows: the bf16 head's packed nibbles hold the codes
    raw = random_blocks(Q.Q8_0, vocab, 64, seed=4)
    table = torch.from_numpy(gguf_dequantize(raw, Q.Q8_0))
    emb = GGUFEmbedding(vocab, 64, activations).to(dtype)
    emb.weight.weight_loader(emb.weight, slice(None), unpack(Q.Q8_0, raw, (vocab, 64), "e"), "e")
    ids = torch.tensor([0, vocab - 1, 17, 17])
    assert torch.equal(emb(ids), table[ids].to(dtype))
    h = torch.randn(3, 64, generator=torch.Generator().manual_seed(5)).to(dtype)
    ref = h.float() @ table.t()
    logits = emb.logits(h).float()
    err = (logits - ref).abs().max().item()
    assert err <= TOLERANCE[activations or dtype] * ref.abs().max().item()
    held_once = (activations or dtype) == torch.bfloat16
    assert (emb.table.codes.numel() == 0) == held_once
    # the packed fp16 scales give back Q8_0's exactly: the table keeps no fp32 copy either
    assert (emb.table.scale.numel() == 0) == (held_once and isinstance(emb.head, NibbleKernel))
    if activations is not None:  # bf16 kernels, fp32 hidden: the top logits refined exactly
        top = ref.topk(GGUFEmbedding.REFINE - 2, dim=-1).indices
        torch.testing.assert_close(logits.gather(-1, top), ref.gather(-1, top))
        assert torch.equal(logits.argmax(-1), ref.argmax(-1))


# ---- whole models ------------------------------------------------------------------------
TINY_TYPES = {  # a format per projection, fused q/k/v and gate/up mixing them
    "attn_q": Q.Q4_K,
    "attn_k": Q.Q6_K,
    "attn_v": Q.Q8_0,
    "attn_output": Q.Q4_1,
    "ffn_gate": Q.Q4_0,
    "ffn_up": Q.Q4_1,
    "ffn_down": Q.Q6_K,
}


def write_quantized_llama(path: Path, types: dict[str, GGMLQuantizationType]) -> None:
    """A 2-layer llama GGUF (hidden 256, 4/2 heads of 64, K-quant-sized) with the projections in
    `types`, Q8_0 embeddings (tied) and F32 norms."""
    tokens = ["<|endoftext|>", *_gpt2_byte_chars(), "Ġt", "he"]
    hidden, inter, heads, kv_heads = 256, 512, 4, 2
    w = GGUFWriter(str(path), "llama")
    for add, value in [
        (w.add_context_length, 256),
        (w.add_embedding_length, hidden),
        (w.add_block_count, 2),
        (w.add_feed_forward_length, inter),
        (w.add_rope_dimension_count, hidden // heads),
        (w.add_head_count, heads),
        (w.add_head_count_kv, kv_heads),
        (w.add_layer_norm_rms_eps, 1e-5),
        (w.add_rope_freq_base, 10000.0),
        (w.add_vocab_size, len(tokens)),
        (w.add_tokenizer_model, "gpt2"),
        (w.add_token_list, tokens),
        (w.add_token_types, [3] + [1] * (len(tokens) - 1)),
        (w.add_token_merges, ["Ġ t", "h e"]),
        (w.add_bos_token_id, 0),
        (w.add_eos_token_id, 0),
    ]:
        add(value)
    seed = iter(range(1000))

    def matrix(name: str, qtype: GGMLQuantizationType, rows: int, cols: int) -> None:
        w.add_tensor(name, random_blocks(qtype, rows, cols, next(seed)), raw_dtype=qtype)

    matrix("token_embd.weight", Q.Q8_0, len(tokens), hidden)
    kv = hidden // heads * kv_heads
    shapes = {
        "attn_q": (hidden, hidden),
        "attn_k": (kv, hidden),
        "attn_v": (kv, hidden),
        "attn_output": (hidden, hidden),
        "ffn_gate": (inter, hidden),
        "ffn_up": (inter, hidden),
        "ffn_down": (hidden, inter),
    }
    norm = (1 + 0.1 * np.random.default_rng(0).standard_normal(hidden)).astype(np.float32)
    for i in range(2):
        for name, shape in shapes.items():
            matrix(f"blk.{i}.{name}.weight", types[name], *shape)
        w.add_tensor(f"blk.{i}.attn_norm.weight", norm)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", norm)
    w.add_tensor("output_norm.weight", norm)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def quantized_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qgguf") / "tiny-mixed.gguf"
    write_quantized_llama(path, TINY_TYPES)
    return path


def test_gguf_weights_equal_transformers_dequantized_ones(tmp_path: Path, cache_root: Path) -> None:
    """Names, the q/k row un-permutation and the values, against transformers' GGUF loader
    (through the de-quantized cache)."""
    from engine.model_loader import load_hf_config

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    expected = dict(iter_weights(str(path)))
    from engine.quant.blocks import dequantize

    got = {
        name: w if isinstance(w, torch.Tensor) else dequantize(w)
        for name, w in iter_gguf_weights(path, load_hf_config(str(path)))
    }
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


PROMPTS = [
    [5, 80, 77, 3],
    [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112, 113, 114, 115, 116, 117],
    [42],
    [7, 7, 7, 7, 7, 9],
]


def _greedy(llm: LLM, max_tokens: int = 16) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_tiny_model_kept_quantized_equals_it_dequantized(
    quantized_llama: Path, cache_root: Path
) -> None:
    small = dict(num_kv_blocks=32, max_model_len=128, device="cpu")
    kept = LLM(str(quantized_llama), quantization="gguf", dtype="float32", **small)
    assert isinstance(kept.llm_engine.runner.model.model.layers[0].mlp.down_proj, GGUFLinear)
    expected = _greedy(LLM(str(quantized_llama), quantization="none", dtype="float32", **small))
    assert _greedy(kept) == expected
    assert len(set(map(tuple, expected))) > 1  # the prompts do not all collapse to one output
    fast = LLM(str(quantized_llama), **small)  # auto: kept quantized, bf16 kernels
    assert fast.llm_engine.config.quantization == "gguf"
    down = fast.llm_engine.runner.model.model.layers[0].mlp.down_proj
    assert (fast.llm_engine.runner.dtype, down.activation_dtype) == (torch.float32, torch.bfloat16)
    agree = sum(a[:4] == b[:4] for a, b in zip(_greedy(fast), expected))
    assert agree >= 3


def test_quantization_option_resolves(
    quantized_llama: Path, tiny_llama_dir: str, cache_root: Path
) -> None:
    gguf = str(quantized_llama)
    cases = [  # (quantization, dtype) -> config.quantization, on the CPU
        ((None, "auto"), "gguf"),
        ((None, "bfloat16"), "gguf"),
        ((None, "float32"), None),
        (("none", "auto"), None),
        (("gguf", "float32"), "gguf"),
    ]
    for (quantization, dtype), expected in cases:
        cfg = build_engine_config(gguf, dtype=dtype, device="cpu", quantization=quantization)
        assert (cfg.quantization, cfg.dtype) == (expected, dtype), (quantization, dtype)
    assert build_engine_config(tiny_llama_dir, device="cpu").quantization is None
    with pytest.raises(ValueError, match="needs a .gguf"):
        build_engine_config(tiny_llama_dir, device="cpu", quantization="gguf")
    assert build_engine_config(gguf, device="cuda", quantization="gguf").quantization == "gguf"
    for name in ("fp8", "compressed-tensors", "awq", "gptq"):  # they read HF folders, not GGUF
        with pytest.raises(ValueError, match="needs an HF folder"):
            build_engine_config(gguf, device="cpu", quantization=name)
    with pytest.raises(ValueError, match="'int3'"):
        build_engine_config(gguf, quantization="int3")
    with pytest.raises(ValueError, match="'none'"):
        EngineConfig(model=gguf, quantization="none")  # the user's word, not the engine's


def test_unsupported_tensor_types_fall_back_or_are_named(tmp_path: Path, cache_root: Path) -> None:
    path = tmp_path / "q5.gguf"
    write_quantized_llama(path, {**TINY_TYPES, "ffn_gate": Q.Q5_0})
    assert build_engine_config(str(path), device="cpu").quantization is None  # de-quantized
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_gate\.weight \(Q5_0\)"):
        build_engine_config(str(path), device="cpu", quantization="gguf")


@pytest.mark.parametrize("command", ["serve", "prefill", "decode"])
def test_quantization_flag_reaches_the_engine(
    command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.async_engine import AsyncLLMEngine
    from engine.core_client import EngineCoreClient
    from pdserve.cli import build_parser
    from pdserve.cluster.worker import build_engine

    seen: dict = {}
    for engine_class in (AsyncLLMEngine, EngineCoreClient):  # serve's runs in its own process
        monkeypatch.setattr(engine_class, "from_args",
                            staticmethod(lambda model, listen="", **kw: seen.update(kw)))
    monkeypatch.delenv("PDSERVE_QUANTIZATION", raising=False)
    build_engine(build_parser().parse_args([command, "--quantization", "none"]), command)
    assert seen["quantization"] == "none"
    build_engine(build_parser().parse_args([command]), command)
    assert seen["quantization"] is None
    monkeypatch.setenv("PDSERVE_QUANTIZATION", "gguf")
    build_engine(build_parser().parse_args([command]), command)
    assert seen["quantization"] == "gguf"


def test_quantization_flag_offline_and_through_up(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve.cli import _engine_kwargs, build_parser
    from pdserve.launcher import add_arguments, plan

    monkeypatch.delenv("PDSERVE_QUANTIZATION", raising=False)
    assert (
        _engine_kwargs(build_parser().parse_args(["demo", "--quantization", "gguf"]))[
            "quantization"
        ]
        == "gguf"
    )
    assert _engine_kwargs(build_parser().parse_args(["generate", "hi"]))["quantization"] is None
    up = argparse.ArgumentParser()
    add_arguments(up)
    for mode in ([], ["--colocated"]):
        services = plan(up.parse_args([*mode, "--quantization", "none"]), "redis://x:1/0", None)
        engines = [
            build_parser().parse_args(s.argv[3:])
            for s in services
            if s.argv[3] in ("prefill", "decode", "serve")
        ]
        assert engines and all(e.quantization == "none" for e in engines)


# ---- the bundled model -------------------------------------------------------------------
@pytest.mark.slow
def test_bundled_model_kept_quantized_agrees_with_hf(bundled_hf_model, hf_oracle) -> None:
    from test_llm_vs_hf import PROMPTS as TEXTS

    llm = LLM(kv_cache_memory=32 << 20, max_model_len=512, device="cpu")
    assert (llm.llm_engine.config.quantization, llm.llm_engine.config.dtype) == ("gguf", "auto")
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in TEXTS]
    params = SamplingParams(temperature=0, max_tokens=32)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    expected = hf_oracle(bundled_hf_model, prompts, 32, llm.llm_engine.eos_token_ids)
    agree = sum(o.outputs[0].token_ids == e for o, e in zip(outs, expected))
    assert agree >= 7, agree
