"""Mixtures of experts from GGUF files (engine/gguf_families.py, engine/gguf_cache.py): tiny
random models of tests/test_moe_models.py written as Q8_0 GGUF files (tests/gguf_writer.py);
pdserve's greedy tokens from each file against HF transformers loading the same file, token for
token in fp32; the families transformers does not read from GGUF are refused, naming the
architecture, before anything is cached."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf_writer import tiny_vocab, write_gguf
from test_moe_models import CONFIGS
from transformers import AutoModelForCausalLM, PretrainedConfig

from engine.gguf_families import config_overrides
from engine.llm import build_engine_config
from pdserve import LLM, SamplingParams

VOCAB = len(tiny_vocab()[0])
PROMPTS = [[75, 83, 72, 258], [33, 34, 35, 36, 37, 38, 39], [260, 264, 261], [100]]


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    """Tiny models on 2 shared cores: OpenMP's hand-offs cost more than the ops."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def gguf_config(name: str, default_widths: bool = False) -> PretrainedConfig:
    """test_moe_models' config of `name` over the tiny vocab, every layer sparse (llama.cpp's
    qwen2moe has no dense layers); `default_widths`: the experts' widths of the config class's
    defaults (what transformers assumes, its GGUF mapping dropping them)."""
    config = CONFIGS[name](VOCAB)
    if hasattr(config, "mlp_only_layers"):
        config.mlp_only_layers = []
    if default_widths:
        defaults = type(config)()
        for field in ("moe_intermediate_size", "shared_expert_intermediate_size"):
            if hasattr(defaults, field):
                setattr(config, field, getattr(defaults, field))
    return config


def write_tiny(config: PretrainedConfig, path: Path) -> Path:
    torch.manual_seed(0)
    write_gguf(AutoModelForCausalLM.from_config(config).to(torch.float32).eval(), path)
    return path


def widths(config: PretrainedConfig) -> dict[str, int]:
    return {
        f: getattr(config, f)
        for f in ("moe_intermediate_size", "shared_expert_intermediate_size")
        if hasattr(config, f)
    }


def hf_from_gguf(path: Path, config_fields: dict[str, int]):
    """The oracle: transformers' own GGUF load of `path` (given `config_fields`)."""
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, local_files_only=True,
        **config_fields,
    ).eval()


READABLE = ["qwen2_moe-shared-top3", "qwen3_moe-top1"]


@pytest.mark.parametrize("default_widths", [True, False], ids=["default-widths", "tiny-widths"])
@pytest.mark.parametrize("name", READABLE)
def test_greedy_from_gguf_equals_transformers_from_the_same_file(
    name: str, default_widths: bool, tmp_path: Path, hf_oracle
) -> None:
    """Four prompts batched. Of the default widths transformers reads the file alone; of other
    widths it needs them given (its GGUF mapping drops them), which pdserve reads from the file."""
    config = gguf_config(name, default_widths)
    path = write_tiny(config, tmp_path / f"{name}.Q8_0.gguf")
    assert config_overrides(path) == widths(config)
    llm = LLM(str(path), dtype="float32", seed=0, kv_cache_memory=16 << 20)
    assert llm.llm_engine.config.quantization is None  # de-quantized: experts stay unquantized
    assert widths(llm.llm_engine.runner.hf_config) == widths(config)
    params = SamplingParams(temperature=0, max_tokens=16)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    hf = hf_from_gguf(path, {} if default_widths else widths(config))
    expected = hf_oracle(hf, PROMPTS, 16, llm.llm_engine.eos_token_ids)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert len(set(map(tuple, expected))) > 1 and max(map(len, expected)) == 16


@pytest.mark.parametrize("name", READABLE)
def test_writer_round_trips_through_transformers(name: str, tmp_path: Path) -> None:
    """The file holds the source model: transformers' GGUF load gives back every tensor within
    Q8_0's error (so the expert stacking, gate before up, and the names are llama.cpp's)."""
    config = gguf_config(name)
    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    write_gguf(source, tmp_path / "m.gguf")
    want, got = source.state_dict(), hf_from_gguf(tmp_path / "m.gguf", widths(config)).state_dict()
    assert want.keys() == got.keys()
    for key, tensor in want.items():
        bound = 0.01 * tensor.abs().max().item() + 1e-6  # Q8_0: 1/127 of a block's largest
        assert (got[key] - tensor).abs().max().item() <= bound, key


def test_kept_quantized_is_refused_and_auto_de_quantizes(tmp_path: Path) -> None:
    """engine/quant/ keeps dense Llama-family layers quantized, not experts: a MoE file on the
    CPU with dtype auto is de-quantized, and asking for "gguf" names the expert tensors."""
    path = write_tiny(gguf_config("qwen3_moe-top1"), tmp_path / "moe.gguf")
    assert build_engine_config(str(path), device="cpu").quantization is None
    with pytest.raises(ValueError, match=r"blk\.N\.ffn_gate_exps\.weight \(no Llama-family"):
        build_engine_config(str(path), device="cpu", quantization="gguf")


REFUSED = {  # family -> (its GGUF architecture, the family named)
    "mixtral-top2": ("llama", "Mixtral"),
    "granitemoe-multipliers": ("granitemoe", "GraniteMoE"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_moe_files_transformers_cannot_read_are_refused(
    name: str, tmp_path: Path, cache_root: Path
) -> None:
    """Mixtral is llama.cpp's `llama` with experts (transformers would build a dense Llama with
    random MLPs); GraniteMoE's architecture transformers does not read at all."""
    arch, family = REFUSED[name]
    path = write_tiny(gguf_config(name), tmp_path / f"{name}.gguf")
    with pytest.raises(ValueError, match=rf"GGUF architecture '{arch}' with experts \({family}\)"):
        LLM(str(path), dtype="float32", kv_cache_memory=16 << 20)
    assert not cache_root.exists() or not any(cache_root.iterdir())


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
def test_tp2_and_ep2_from_gguf_equal_transformers(
    expert_parallel: bool, tmp_path: Path, hf_oracle
) -> None:
    """Qwen2-MoE from its GGUF on two gloo ranks: the cache's stacked experts sliced by
    intermediate rows (TP) or whole, 3 of 6 per rank (EP); both generate what HF does."""
    config = gguf_config("qwen2_moe-shared-top3")
    path = write_tiny(config, tmp_path / "moe.gguf")
    llm = LLM(str(path), dtype="float32", device="cpu", seed=0, kv_cache_memory=8 << 20,
              tensor_parallel_size=2, enable_expert_parallel=expert_parallel)
    try:
        experts = llm.llm_engine.runner.model.model.layers[1].mlp.experts  # rank 0's
        assert (experts.experts, len(experts.rows)) == (
            (range(0, 3), 32) if expert_parallel else (range(6), 16)
        )
        params = SamplingParams(temperature=0, max_tokens=12)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        eos = llm.llm_engine.eos_token_ids
    finally:
        llm.llm_engine.shutdown()
    expected = hf_oracle(hf_from_gguf(path, widths(config)), PROMPTS, 12, eos)
    assert [o.outputs[0].token_ids for o in outs] == expected
