"""The engine's own encode / decode (engine/text_codec.py): HF's results for the tokenizers it
takes, None for the others, and an LLM that never loads transformers' tokenizer until asked."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.model_loader import _hf_source
from engine.text_codec import TextCodec, load_codec

TEXTS = [
    "Hello, world!", "  leading and trailing spaces  ", "tabs\tand\nnewlines\r\n",
    "naïve café — “quotes” 日本語 🚀 emoji", "don't , . ! ? isn't",
    "<|im_start|>user\nhi<|im_end|>",
    "x" * 300, "def f(a, b):\n    return a + b  # comment", "1234567890 3.14159 -42",
    " <|endoftext|> between <|im_end|>", "\u00a0non-breaking\u2009thin", "",
]


@pytest.fixture(scope="module")
def codec_folder(bundled_path: str) -> str:
    folder, _ = _hf_source(bundled_path, None, need_tokenizer=True)
    return folder


def test_the_bundled_tokenizer_encodes_and_decodes_as_hf(codec_folder: str,
                                                         bundled_tokenizer) -> None:
    codec = load_codec(codec_folder)
    assert isinstance(codec, TextCodec)
    assert codec.eos_token_id == bundled_tokenizer.eos_token_id
    for text in TEXTS:
        for special in (True, False):
            ids = codec.encode(text, add_special_tokens=special)
            assert ids == bundled_tokenizer.encode(text, add_special_tokens=special), text
        ids = bundled_tokenizer.encode(text)
        for skip in (False, True):
            assert codec.decode(ids, skip_special_tokens=skip) == bundled_tokenizer.decode(
                ids, skip_special_tokens=skip), text
    ids = list(range(0, 49152, 97))  # arbitrary ids, partial UTF-8 sequences among them
    assert codec.decode(ids) == bundled_tokenizer.decode(ids)


@pytest.mark.parametrize("change", [{"tokenizer_class": "LlamaTokenizerFast"},
                                    {"add_bos_token": True},
                                    {"clean_up_tokenization_spaces": True}])
def test_tokenizers_it_cannot_match_are_left_to_hf(codec_folder: str, tmp_path: Path,
                                                   change: dict) -> None:
    """A class with its own Python (SentencePiece-style Llama), a post-processor rewritten from
    the config, spaces cleaned up after decoding: None, and the engine uses HF's tokenizer."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(codec_folder) / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, **change}))
    assert load_codec(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_codec(tmp_path) is not None
    (tmp_path / "tokenizer.json").unlink()
    assert load_codec(tmp_path) is None


def test_an_llm_loads_hf_tokenizer_only_when_asked(bundled_path: str) -> None:
    """In a fresh process: LLM() and generate on a text prompt import no transformers; the
    tokenizer users get from get_tokenizer() is HF's, and its encoding is the engine's."""
    script = f"""
import sys
from pdserve import LLM, SamplingParams
llm = LLM({bundled_path!r}, device="cpu", kv_cache_memory=16 << 20, max_model_len=256)
out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4),
                   use_tqdm=False)[0]
assert "transformers" not in sys.modules, "transformers imported"
tok = llm.get_tokenizer()
assert type(tok).__module__.startswith("transformers")
assert tok.encode("The capital of France is") == list(out.prompt_token_ids)
assert tok.decode(out.outputs[0].token_ids) == out.outputs[0].text
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-2000:]
