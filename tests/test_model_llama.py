"""The Llama-family model and the torch attention backend against HF transformers and a naive
reference, over shuffled block tables and lengths that straddle block edges."""

from __future__ import annotations

import pytest
import torch
from _model_helpers import (
    SeqChunk,
    build_metadata,
    naive_paged_attention,
    positions_of,
    shuffled_block_tables,
    zero_kv_caches,
)
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.attention.torch_backend import TorchAttentionBackend
from engine.models import LlamaForCausalLM, get_model_class
from engine.models.rotary import RotaryEmbedding, rope_parameters

BLOCK_SIZE = 16
NUM_BLOCKS = 32
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)
CONFIGS = {
    "llama-gqa-untied": lambda: LlamaConfig(**TINY, tie_word_embeddings=False),
    "llama-tied-biases": lambda: LlamaConfig(
        **TINY, tie_word_embeddings=True, attention_bias=True, mlp_bias=True
    ),
    "llama3-rope": lambda: LlamaConfig(
        **TINY,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "qwen2-bias-tied": lambda: Qwen2Config(**TINY, tie_word_embeddings=True),
    "mistral-mqa-headdim": lambda: MistralConfig(
        **{**TINY, "num_key_value_heads": 1}, head_dim=32, tie_word_embeddings=False
    ),
}

# Two steps over four sequences (name: tokens). Step 2 mixes a whole prompt, a chunk continuing a
# sequence cached in step 1 (21 -> 35 tokens, straddling 32), and two decodes (31 -> 32, 16 -> 17).
SEQ_LENS = {"a": 35, "b": 19, "c": 32, "d": 17}
STEPS = [
    [("a", 0, 21), ("c", 0, 31), ("d", 0, 16)],
    [("b", 0, 19), ("a", 21, 14), ("c", 31, 1), ("d", 16, 1)],
]


def make_hf_model(config: PretrainedConfig, seed: int = 0) -> torch.nn.Module:
    """A seeded HF model with weights large enough that every term matters in the logits."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.2)
    return model


def make_paged_model(config: PretrainedConfig, hf_model: torch.nn.Module) -> torch.nn.Module:
    model = get_model_class(config)(config, TorchAttentionBackend()).eval()
    model.load_weights(hf_model.state_dict().items())
    return model


def run_paged(
    model: torch.nn.Module,
    config: PretrainedConfig,
    tokens: dict[str, torch.Tensor],
    steps: list[list[tuple[str, int, int]]],
) -> dict[str, torch.Tensor]:
    """Run the steps through the paged model; logits of every position of every sequence."""
    lens = {name: len(t) for name, t in tokens.items()}
    tables = dict(zip(lens, shuffled_block_tables(list(lens.values()), BLOCK_SIZE, NUM_BLOCKS, 1)))
    head_dim = model.model.layers[0].self_attn.head_dim
    kv_caches = zero_kv_caches(
        config.num_hidden_layers, NUM_BLOCKS, BLOCK_SIZE, config.num_key_value_heads, head_dim
    )
    logits = {name: torch.full((n, config.vocab_size), float("nan")) for name, n in lens.items()}
    for step in steps:
        chunks = [SeqChunk(tables[name], cached, new) for name, cached, new in step]
        meta = build_metadata(chunks, BLOCK_SIZE)
        input_ids = torch.cat([tokens[name][c : c + n] for name, c, n in step])
        with torch.no_grad():
            hidden = model(input_ids, positions_of(chunks), kv_caches, meta)  # [T, hidden]
            step_logits = model.compute_logits(hidden)
        for (name, cached, new), start in zip(step, meta.query_start_loc_cpu, strict=False):
            logits[name][cached : cached + new] = step_logits[start : start + new]
    return logits


@pytest.mark.parametrize("name", list(CONFIGS))
def test_paged_model_matches_hf(name: str) -> None:
    config = CONFIGS[name]()
    hf_model = make_hf_model(config)
    model = make_paged_model(config, hf_model)
    gen = torch.Generator().manual_seed(2)
    tokens = {
        s: torch.randint(0, config.vocab_size, (n,), generator=gen) for s, n in SEQ_LENS.items()
    }
    logits = run_paged(model, config, tokens, STEPS)
    for seq, ids in tokens.items():
        with torch.no_grad():
            expected = hf_model(ids[None]).logits[0].float()  # [L, V]
        assert logits[seq].dtype == torch.float32
        torch.testing.assert_close(logits[seq], expected, atol=1e-4, rtol=1e-4, msg=seq)


def test_fused_weights_hold_hf_projections() -> None:
    config = CONFIGS["qwen2-bias-tied"]()
    hf_model = make_hf_model(config)
    model = make_paged_model(config, hf_model)
    hf_attn, attn = hf_model.model.layers[1].self_attn, model.model.layers[1].self_attn
    qkv_weight = torch.cat([hf_attn.q_proj.weight, hf_attn.k_proj.weight, hf_attn.v_proj.weight])
    assert torch.equal(attn.qkv_proj.weight, qkv_weight)
    assert torch.equal(attn.qkv_proj.bias[64:96], hf_attn.k_proj.bias)
    assert attn.o_proj.bias is None and model.lm_head is None


def test_load_weights_rejects_unknown_missing_and_misshapen() -> None:
    config = CONFIGS["llama-gqa-untied"]()
    state = make_hf_model(config).state_dict()
    model = LlamaForCausalLM(config, TorchAttentionBackend())
    with pytest.raises(ValueError, match="unknown weight 'model.layers.0.foo.weight'"):
        model.load_weights([*state.items(), ("model.layers.0.foo.weight", torch.zeros(1))])
    partial = {k: v for k, v in state.items() if k != "model.layers.1.self_attn.v_proj.weight"}
    with pytest.raises(ValueError, match=r"missing.*layers\.1\.self_attn\.qkv_proj\.weight\[v\]"):
        model.load_weights(partial.items())
    with pytest.raises(ValueError, match="'model.norm.weight' has shape"):
        model.load_weights([*state.items(), ("model.norm.weight", torch.zeros(3))])


def test_get_model_class_names_unsupported_architecture() -> None:
    assert get_model_class(LlamaConfig(architectures=["MistralForCausalLM"])) is LlamaForCausalLM
    assert get_model_class(Qwen2Config()) is LlamaForCausalLM
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        get_model_class(LlamaConfig(architectures=["GPT2LMHeadModel"]))


def test_llama3_inv_freq_equals_hf() -> None:
    config = CONFIGS["llama3-rope"]()
    expected, scaling = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    rotary = RotaryEmbedding(16, rope_parameters(config))
    assert scaling == 1.0
    assert torch.equal(rotary.inv_freq, expected)


# ---- the torch attention backend alone ----------------------------------------------------------

BACKEND_CHUNKS = [(0, 17), (15, 18), (31, 1), (16, 1), (0, 1), (47, 1)]  # (cached, new)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "num_blocks"), [(9, 3, 40), (4, 1, 4096)])
def test_torch_backend_matches_naive_reference(
    num_heads: int, num_kv_heads: int, num_blocks: int, dtype: torch.dtype, device: str
) -> None:
    head_dim, scale = 64, 0.125
    gen = torch.Generator().manual_seed(3)
    seq_lens = [c + n for c, n in BACKEND_CHUNKS]
    tables = shuffled_block_tables(seq_lens, BLOCK_SIZE, num_blocks, seed=4)
    chunks = [SeqChunk(t, c, n) for t, (c, n) in zip(tables, BACKEND_CHUNKS, strict=True)]
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen)
    kv_cache = kv_cache.to(device, dtype)
    meta = build_metadata(chunks, BLOCK_SIZE, device)
    num_tokens = meta.num_tokens
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(device, dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(device, dtype)

    backend = TorchAttentionBackend()
    backend.prepare(meta)
    out = backend.forward(q, k, v, kv_cache, meta, scale)

    flat = kv_cache.flatten(1, 2)  # [2, num_blocks * block_size, Hkv, D]
    assert torch.equal(flat[0, meta.slot_mapping], k) and torch.equal(flat[1, meta.slot_mapping], v)
    expected = naive_paged_attention(q.cpu().double(), kv_cache.cpu().double(), chunks, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.shape == (num_tokens, num_heads, head_dim) and out.dtype == dtype
    torch.testing.assert_close(out.cpu().double(), expected, atol=tol, rtol=tol)


# ---- the bundled SmolLM2-135M (30 layers, 9/3 heads, head_dim 64) -----------------------------


@pytest.mark.slow
def test_bundled_smollm2_matches_hf() -> None:
    from engine.model_loader import iter_weights, load_hf_config, load_hf_model, resolve_model

    path = resolve_model(None)
    config, hf_model = load_hf_config(path), load_hf_model(path, torch.float32)
    model = get_model_class(config)(config, TorchAttentionBackend()).eval()
    model.load_weights(iter_weights(path))
    gen = torch.Generator().manual_seed(5)
    tokens = {
        s: torch.randint(0, config.vocab_size, (n,), generator=gen)
        for s, n in [("p", 40), ("q", 19)]
    }
    steps = [  # prefill, chunk + decode, decode + decode; 40 straddles 32, 17 straddles 16
        [("p", 0, 24), ("q", 0, 17)],
        [("p", 24, 15), ("q", 17, 1)],
        [("p", 39, 1), ("q", 18, 1)],
    ]
    logits = run_paged(model, config, tokens, steps)
    for seq, ids in tokens.items():
        with torch.no_grad():
            expected = hf_model(ids[None]).logits[0].float()  # [L, V]
        torch.testing.assert_close(logits[seq], expected, atol=1e-4, rtol=1e-5, msg=seq)
        assert torch.equal(logits[seq].argmax(-1), expected.argmax(-1))
