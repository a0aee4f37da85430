"""A GGUF's cached config.json read without transformers' config classes (engine/saved_config.py):
the same values the engine reads as AutoConfig gives, the same tokenizer, and an engine on the
bundled GGUF that never imports transformers' model configs, torch._dynamo or sympy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer

from engine.model_loader import load_hf_config, load_tokenizer, resolve_model
from engine.saved_config import PLAIN_MODEL_TYPES, SavedConfig, read_saved_config

MISSING = object()
# every attribute the engine reads from a model config (engine/models/, engine/quant/,
# engine/kv_cache_sizing.py, engine/request_checks.py, tokenizer_svc/)
READ_BY_ENGINE = (
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "rope_parameters",
    "attention_bias", "mlp_bias", "qkv_bias", "use_sliding_window", "sliding_window",
    "eos_token_id", "quantization_config", "num_experts", "num_local_experts",
)
SMALL = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2}


def _assert_same_fields(saved: SavedConfig, real: object) -> None:
    for name in READ_BY_ENGINE:
        assert getattr(saved, name, MISSING) == getattr(real, name, MISSING), name
    skip = ("transformers_version",)  # the version of the transformers that wrote the file
    expected = {k: v for k, v in real.to_dict().items() if k not in skip}
    mine = {k: v for k, v in saved.to_dict().items() if k not in skip}
    assert mine == expected  # to_dict writes dtype as its name, as config.json does


@pytest.mark.parametrize("model_type", sorted(PLAIN_MODEL_TYPES))
@pytest.mark.parametrize("tied", [False, True])
def test_saved_config_reads_what_autoconfig_reads(
    model_type: str, tied: bool, tmp_path: Path
) -> None:
    AutoConfig.for_model(model_type, tie_word_embeddings=tied, **SMALL).save_pretrained(tmp_path)
    real = AutoConfig.from_pretrained(tmp_path, local_files_only=True)
    saved = read_saved_config(tmp_path)
    assert saved is not None and type(real).attribute_map == {}  # no aliased names
    assert saved._name_or_path == real._name_or_path == str(tmp_path)
    assert saved.tie_word_embeddings is tied
    _assert_same_fields(saved, real)


@pytest.mark.parametrize("fields", [{"model_type": "qwen2_moe"}, {"model_type": "mixtral"},
                                    {"model_type": "llama", "auto_map": {}}])
def test_other_configs_are_left_to_transformers(fields: dict, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(fields))
    assert read_saved_config(tmp_path) is None


@pytest.mark.slow
def test_bundled_gguf_config_and_tokenizer_equal_transformers() -> None:
    path = resolve_model(None)
    config = load_hf_config(path)
    assert isinstance(config, SavedConfig)
    folder = config._name_or_path
    _assert_same_fields(config, AutoConfig.from_pretrained(folder, local_files_only=True))
    tokenizer = load_tokenizer(path)
    oracle = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert type(tokenizer) is type(oracle)
    assert tokenizer.init_kwargs == oracle.init_kwargs
    assert tokenizer.get_vocab() == oracle.get_vocab()
    assert tokenizer.chat_template == oracle.chat_template
    text = "Héllo, wörld! 1234 <|im_start|>user\n  tabs\tand 🙂"
    assert tokenizer(text)["input_ids"] == oracle(text)["input_ids"]
    messages = [{"role": "user", "content": "Hi"}]
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True) == (
        oracle.apply_chat_template(messages, add_generation_prompt=True))


LOAD_AND_LIST = """
import sys
from pdserve import LLM
llm = LLM(None, kv_cache_memory=16 << 20, max_model_len=256, device="cpu")
heavy = ("transformers.models.llama", "transformers.modeling_utils", "torch._dynamo", "sympy")
print([m for m in heavy if m in sys.modules])
"""


@pytest.mark.slow
def test_cpu_gguf_engine_imports_no_transformers_model_code() -> None:
    """Building the engine on the bundled GGUF (cached) imports none of transformers' model or
    config modules, hence neither torch._dynamo nor sympy (~90 MiB resident)."""
    load_tokenizer(resolve_model(None))  # the cache exists before the subprocess runs
    out = subprocess.run([sys.executable, "-c", LOAD_AND_LIST], check=True, capture_output=True,
                         text=True, cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip().splitlines()[-1] == "[]"
