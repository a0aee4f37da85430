"""Mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE, GraniteMoE) and dense Qwen3
against HF transformers: logits over a batched, paged run; each sparse block alone with an idle
expert; and greedy generation through pdserve's `LLM` from a saved checkpoint, token for token."""

from __future__ import annotations

import pytest
import torch
from test_model_llama import SEQ_LENS, STEPS, make_hf_model, make_paged_model, run_paged
from transformers import (
    AutoModelForCausalLM,
    GraniteMoeConfig,
    MixtralConfig,
    PretrainedConfig,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from engine.attention.torch_backend import TorchAttentionBackend
from engine.models import get_model_class
from engine.models.moe import FusedMoE, SparseMoeBlock
from pdserve import LLM, SamplingParams


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """Tiny models on 2 shared cores: OpenMP's hand-offs cost more than the ops (4x here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    initializer_range=0.2,  # HF's 0.02 makes a near-uniform model that repeats its prompt
)
CONFIGS = {
    "mixtral-top2": lambda v: MixtralConfig(
        **TINY, vocab_size=v, num_local_experts=4, num_experts_per_tok=2
    ),
    # top 3 of 6, not renormalised; layer 0 dense (mlp_only_layers), layer 1 sparse + shared
    "qwen2_moe-shared-top3": lambda v: Qwen2MoeConfig(
        **TINY,
        vocab_size=v,
        num_experts=6,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        mlp_only_layers=[0],
        norm_topk_prob=False,
    ),
    "qwen3-dense-biases": lambda v: Qwen3Config(
        **TINY, vocab_size=v, head_dim=32, attention_bias=True, tie_word_embeddings=True
    ),
    "qwen3_moe-top1": lambda v: Qwen3MoeConfig(
        **TINY,
        vocab_size=v,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=1,
        moe_intermediate_size=32,
        norm_topk_prob=True,
    ),
    "granitemoe-multipliers": lambda v: GraniteMoeConfig(
        **TINY,
        vocab_size=v,
        num_local_experts=5,
        num_experts_per_tok=3,
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_multiplier=0.1,
        logits_scaling=3.0,
        tie_word_embeddings=True,
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_paged_moe_model_matches_hf_logits(name: str) -> None:
    """Four sequences over two steps (prefill chunks and decodes mixed) against HF, per token."""
    config = CONFIGS[name](256)
    hf_model = make_hf_model(config)
    model = make_paged_model(config, hf_model)  # loads HF's in-memory (stacked) expert names
    gen = torch.Generator().manual_seed(2)
    tokens = {
        s: torch.randint(0, config.vocab_size, (n,), generator=gen) for s, n in SEQ_LENS.items()
    }
    logits = run_paged(model, config, tokens, STEPS)
    for seq, ids in tokens.items():
        with torch.no_grad():
            expected = hf_model(ids[None]).logits[0].float()  # [L, V]
        torch.testing.assert_close(logits[seq], expected, atol=1e-4, rtol=1e-4, msg=seq)


HF_BLOCKS = {  # family -> HF's sparse block of layer 1 (ours is always layers[1].mlp)
    "mixtral-top2": lambda hf: hf.model.layers[1].mlp,
    "qwen2_moe-shared-top3": lambda hf: hf.model.layers[1].mlp,
    "granitemoe-multipliers": lambda hf: hf.model.layers[1].block_sparse_moe,
}


@pytest.mark.parametrize("name", list(HF_BLOCKS))
def test_sparse_block_with_an_idle_expert_matches_hf(name: str) -> None:
    """Positive inputs and an all -1 router row for expert 1: no token picks it. The block
    still equals HF's, and expert 1 is never run (its weights are NaN here)."""
    config = CONFIGS[name](256)
    hf_model = make_hf_model(config)
    hf_block = HF_BLOCKS[name](hf_model)
    router = hf_block.router if hasattr(hf_block, "router") else hf_block.gate
    with torch.no_grad():
        router.weight[1] = -1.0
    model = make_paged_model(config, hf_model)
    block = model.model.layers[1].mlp
    assert isinstance(block, SparseMoeBlock)
    x = torch.randn(7, config.hidden_size, generator=torch.Generator().manual_seed(3)).abs()
    with torch.no_grad():
        _, ids = block.route(x)
        assert not (ids == 1).any()
        block.experts.w13[1] = float("nan")
        expected = hf_block(x[None])[0]
        out = block(x)
    scale = config.residual_multiplier if name.startswith("granite") else 1.0
    torch.testing.assert_close(out, expected * scale, atol=1e-5, rtol=1e-5)


def test_load_weights_rejects_missing_and_unknown_experts() -> None:
    config = CONFIGS["mixtral-top2"](256)
    state = make_hf_model(config).state_dict()
    model = get_model_class(config)(config, TorchAttentionBackend())
    partial = {k: v for k, v in state.items() if "layers.1.mlp.experts" not in k}
    with pytest.raises(ValueError, match=r"missing.*layers\.1\.mlp\.experts: expert 0\.gate"):
        model.load_weights(partial.items())
    legacy = [("model.layers.0.block_sparse_moe.experts.4.w1.weight", torch.zeros(96, 64))]
    with pytest.raises(ValueError, match="expert 4 of 4"):
        model.load_weights([*state.items(), *legacy])


def test_expert_parallel_rank_holds_whole_experts() -> None:
    """EP over 2 ranks: rank 1 holds experts 2..4 of 5 with every intermediate row."""

    class Rank1:
        rank, world_size = 1, 2

    ep = FusedMoE(5, 8, 6, Rank1(), expert_parallel=True)
    tp = FusedMoE(5, 8, 6, Rank1(), expert_parallel=False)
    assert ep.experts == range(3, 5) and tuple(ep.w13.shape) == (2, 12, 8)
    assert tp.experts == range(5) and tuple(tp.w13.shape) == (5, 6, 8)
    down = torch.arange(8 * 6, dtype=torch.float32).view(8, 6)
    tp.load_expert(4, "down", down, "down")
    assert torch.equal(tp.w2[4], down[:, 3:])  # rank 1's intermediate columns
    ep.load_expert(0, "down", down, "down")  # another rank's expert: nothing to do
    ep.load_expert(4, "down", down, "down")
    assert torch.equal(ep.w2[1], down) and ep.loaded == {(1, "down")}


def test_expert_parallel_needs_an_expert_per_rank() -> None:
    class Rank0:
        rank, world_size = 0, 4

    with pytest.raises(ValueError, match="3 experts, 4 ranks"):
        FusedMoE(3, 8, 6, Rank0(), expert_parallel=True)


# ---- end to end: a saved checkpoint (HF's on-disk expert names) through LLM.generate ----------

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,", "Hello"]


def save_tiny(config: PretrainedConfig, tokenizer, path) -> str:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_llm_greedy_matches_hf(name, tmp_path, bundled_tokenizer, hf_oracle) -> None:
    """Four prompts batched together; each decode step carries 4 tokens, so e.g. Qwen3-MoE's
    top 1 of 8 leaves at least half the experts without a token in every decode batch."""
    from engine.model_loader import load_hf_model

    config = CONFIGS[name](len(bundled_tokenizer))
    config.bos_token_id, config.eos_token_id = 1, 2
    path = save_tiny(config, bundled_tokenizer, tmp_path)
    llm = LLM(path, dtype="float32", seed=0, kv_cache_memory=16 << 20)
    prompts = [bundled_tokenizer.encode(p) for p in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    expected = hf_oracle(load_hf_model(path), prompts, 16, llm.llm_engine.eos_token_ids)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert len(set(map(tuple, expected))) > 1  # the model does not just repeat one thing


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
def test_tp2_and_ep2_greedy_equal_hf(expert_parallel, tmp_path, bundled_tokenizer, hf_oracle):
    """Qwen2-MoE (dense layer, shared expert, 6 experts top 3) on two gloo ranks: experts sliced
    by intermediate rows (TP) or whole, 3 per rank (EP); both generate what HF does."""
    from engine.model_loader import load_hf_model

    config = CONFIGS["qwen2_moe-shared-top3"](len(bundled_tokenizer))
    config.bos_token_id, config.eos_token_id = 1, 2
    path = save_tiny(config, bundled_tokenizer, tmp_path)
    llm = LLM(
        path,
        dtype="float32",
        device="cpu",
        seed=0,
        kv_cache_memory=8 << 20,
        tensor_parallel_size=2,
        enable_expert_parallel=expert_parallel,
    )
    try:
        experts = llm.llm_engine.runner.model.model.layers[1].mlp.experts  # rank 0's
        assert (experts.experts, len(experts.rows)) == (
            (range(0, 3), 32) if expert_parallel else (range(6), 16)
        )
        prompts = [bundled_tokenizer.encode(p) for p in PROMPTS]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
        eos = llm.llm_engine.eos_token_ids
    finally:
        llm.llm_engine.shutdown()
    expected = hf_oracle(load_hf_model(path), prompts, 12, eos)
    assert [o.outputs[0].token_ids for o in outs] == expected
