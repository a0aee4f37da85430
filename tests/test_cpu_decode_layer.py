"""engine/models/cpu_decode_layer.py: a quantized Llama layer's decode steps as one C call give
the same tokens and logprobs, bit for bit, as the layer's modules (the same kernels in the same
order), in batched decodes of different lengths; layers it does not compute (mixed GGUF formats
in one projection) keep their modules; steps with a prefill keep them too."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGMLQuantizationType
from test_quant_gguf import write_quantized_llama

import engine.models.cpu_decode_layer as fused_layer
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from kernels import cpu_decode_layer

Q = GGMLQuantizationType
pytestmark = pytest.mark.skipif(cpu_decode_layer.library() is None,
                                reason="no AVX512-BF16 or no C compiler here")
UNIFORM = {"attn_q": Q.Q4_1, "attn_k": Q.Q4_1, "attn_v": Q.Q4_1, "attn_output": Q.Q8_0,
           "ffn_gate": Q.Q4_0, "ffn_up": Q.Q4_0, "ffn_down": Q.Q4_1}
MIXED = {**UNIFORM, "attn_v": Q.Q8_0}  # q/k/v in two formats: two kernels for one projection
PROMPTS = [[1, 17, 30, 58, 90, 44, 12, 7] * 3, [1, 50, 13, 99], list(range(100, 140))]
SMALL = dict(num_kv_blocks=32, max_model_len=128, device="cpu")


@pytest.fixture
def cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _generate(path: Path) -> list:
    llm = LLM(str(path), **SMALL)  # auto: kept quantized, bf16 kernels
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], llm


def test_the_fused_layer_equals_the_modules(tmp_path: Path, cache_root: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "uniform.gguf"
    write_quantized_llama(path, UNIFORM)
    calls = []
    real = fused_layer.cpu_decode_layer.run
    monkeypatch.setattr(fused_layer.cpu_decode_layer, "run",
                        lambda *a: calls.append(a[3].shape[0]) or real(*a))
    fused, llm = _generate(path)
    # 2 layers x 11 decode steps (the first token comes from the prefill), 3 rows, then fewer
    assert len(calls) == 22 and max(calls) == 3
    assert isinstance(llm.llm_engine.runner.model.model.layers[0].__dict__["_cpu_decode_plan"],
                      cpu_decode_layer.LayerArgs)
    monkeypatch.setattr(fused_layer.cpu_decode_layer, "library", lambda: None)
    modules, _ = _generate(path)
    assert len(calls) == 22  # the second engine never took it
    assert fused == modules
    assert len({tuple(tokens) for tokens, _ in fused}) > 1


def test_a_layer_it_does_not_compute_keeps_its_modules(tmp_path: Path, cache_root: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "mixed.gguf"
    write_quantized_llama(path, MIXED)
    monkeypatch.setattr(fused_layer.cpu_decode_layer, "run",
                        lambda *a: pytest.fail("the fused layer ran"))
    _, llm = _generate(path)
    assert llm.llm_engine.runner.model.model.layers[0].__dict__["_cpu_decode_plan"] == (
        fused_layer._NOT_FUSED)
