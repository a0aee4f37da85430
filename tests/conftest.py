"""Shared fixtures: the bundled model, tiny random HF models on disk, and the HF greedy oracle."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Without a GPU, Triton kernels run in its interpreter (numpy on the CPU; slow: small shapes).
# Set before anything imports triton: @triton.jit reads it when a kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module", autouse=True)
def _collect_engines_after_each_module():
    """Engines hold reference cycles (threads, callbacks): collect them when their module ends,
    so their weights and KV caches do not pile up over the session (a 24 GiB box ran out)."""
    yield
    import gc

    gc.collect()


@pytest.fixture(scope="session")
def redis_url():
    """A throw-away real redis-server for the whole session (tests/redis_server.py)."""
    from redis_server import run_redis_server

    with run_redis_server() as url:
        yield url


@pytest.fixture(scope="session")
def bundled_path() -> str:
    from engine.model_loader import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def bundled_tokenizer():
    """The bundled model's tokenizer; from PDSERVE_TEST_TOKENIZER (a folder) where the bundled
    package is not installed (the GPU machine gets the tokenizer files carried)."""
    from engine.model_loader import load_tokenizer, resolve_model

    folder = os.environ.get("PDSERVE_TEST_TOKENIZER")
    if folder:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return load_tokenizer(resolve_model(None))


@pytest.fixture(scope="session")
def bundled_hf_model(bundled_path):
    from engine.model_loader import load_hf_model

    return load_hf_model(bundled_path, torch.float32)


@pytest.fixture(scope="session")
def bundled_async_engine():
    """One AsyncLLMEngine on the bundled model (fp32, 2048-token context) for the in-process
    gateway tests, loaded once."""
    from engine.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine.from_args(None, dtype="float32", max_model_len=2048,
                                      kv_cache_memory=128 << 20)
    yield engine
    engine.shutdown()


def _save_tiny(config, tokenizer, path: Path) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def cuda_llama_dir(tmp_path_factory, bundled_tokenizer) -> str:
    """The GPU tests' random Llama: the bundled model's 9/3 GQA and head_dim 64, 4 layers."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=len(bundled_tokenizer), hidden_size=576, intermediate_size=1536,
        num_hidden_layers=4, num_attention_heads=9, num_key_value_heads=3,
        max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        rope_theta=100000.0, initializer_range=0.1,
    )
    return _save_tiny(cfg, bundled_tokenizer, tmp_path_factory.mktemp("cuda_llama"))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, bundled_tokenizer) -> str:
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=len(bundled_tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, rope_theta=10000.0,
        initializer_range=0.2,  # HF's 0.02 gives a near-uniform model that repeats its prompt
    )
    return _save_tiny(cfg, bundled_tokenizer, tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, bundled_tokenizer) -> str:
    from transformers import Qwen2Config

    cfg = Qwen2Config(
        vocab_size=len(bundled_tokenizer), hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, initializer_range=0.2,
    )
    return _save_tiny(cfg, bundled_tokenizer, tmp_path_factory.mktemp("tiny_qwen2"))


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int, eos_ids) -> list[list[int]]:
    """HF transformers greedy continuation of each prompt on its own (no padding)."""
    eos = sorted(eos_ids)
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                do_sample=False, eos_token_id=eos, pad_token_id=eos[0],
            )
            new = y[0, len(ids):].tolist()
            ends = [i for i, t in enumerate(new) if t in eos_ids]
            outs.append(new[: ends[0] + 1] if ends else new)
    return outs


@pytest.fixture(scope="session")
def hf_oracle():
    return hf_greedy
