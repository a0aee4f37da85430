"""Multi-LoRA in the engine: greedy tokens equal HF transformers + PEFT's, one batch mixing the
base model and several adapters; slots and the prefix cache per adapter; bad adapters."""

from __future__ import annotations

import json

import pytest
import torch
from lora_helpers import make_adapter, peft_model

from engine.block_manager import prefix_hashes
from engine.llm import LLM
from engine.lora import LoRAInUseError, LoRARequest
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[1, 17, 230, 58, 901, 44, 12, 7], [1, 505, 13, 99, 1000, 4], [1, 3, 4, 5, 6, 7, 8, 9],
           [1, 640, 641, 642, 77, 9]]


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, str]:
    """Three adapters of the tiny Llama: ranks 4/8/16, every projection / q,v only / the MLP
    only, one with rsLoRA scaling."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "all4": make_adapter(tiny_llama_dir, root / "all4", rank=4, seed=1, scale=3.0),
        "qv8": make_adapter(tiny_llama_dir, root / "qv8", rank=8, targets=("q_proj", "v_proj"),
                            seed=2, scale=3.0, use_rslora=True),
        "mlp16": make_adapter(tiny_llama_dir, root / "mlp16", rank=16,
                              targets=("gate_proj", "up_proj", "down_proj"), seed=3, scale=3.0),
    }


@pytest.fixture(scope="module")
def lora_llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, dtype="float32", device="cpu", kv_cache_memory=32 << 20,
               enable_lora=True, max_loras=4, max_lora_rank=16)


def _req(adapters: dict[str, str], name: str, int_id: int = 1) -> LoRARequest:
    return LoRARequest(name, int_id, adapters[name])


def _tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


@torch.inference_mode()
def _greedy(model, prompts: list[list[int]], n: int = GREEDY.max_tokens) -> list[list[int]]:
    """HF (or PEFT) greedy continuation of each prompt, eos ignored, as GREEDY asks."""
    outs = []
    for ids in prompts:
        x = torch.tensor([ids])
        for _ in range(n):
            x = torch.cat([x, model(x).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        outs.append(x[0, len(ids):].tolist())
    return outs


def _oracle(base, adapter_dir: str | None) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = (peft_model(base, adapter_dir) if adapter_dir is not None
             else AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32).eval())
    return _greedy(model, PROMPTS)


def test_one_batch_mixes_base_and_three_adapters_like_peft(
    lora_llm, adapters, tiny_llama_dir
):
    names = [None, "all4", "qv8", "mlp16"]
    reqs = [None if n is None else _req(adapters, n, i + 1) for i, n in enumerate(names)]
    # every prompt under every choice, all in one generate call: one batch mixes all four
    prompts = [p for p in PROMPTS for _ in names]
    loras = [r for _ in PROMPTS for r in reqs]
    got = _tokens(lora_llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
    for j, name in enumerate(names):
        want = _oracle(tiny_llama_dir, None if name is None else adapters[name])
        assert got[j::len(names)] == want, name
    base = got[0::4]
    for j in (1, 2, 3):  # each adapter moves the tokens: the test can see a lost delta
        assert got[j::4] != base


def test_more_adapters_than_slots_take_turns(tiny_llama_dir, adapters):
    """max_loras=2 with three adapters in one call: the scheduler runs at most two adapters at a
    time and the slots are reloaded; every output still equals PEFT's."""
    llm = LLM(tiny_llama_dir, dtype="float32", device="cpu", kv_cache_memory=32 << 20,
              enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=3)
    names = ["all4", "qv8", "mlp16"]
    prompts = [PROMPTS[0]] * 3 + [PROMPTS[1]] * 3
    loras = [_req(adapters, n, i + 1) for i, n in enumerate(names)] * 2
    got = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
    for i, name in enumerate(names):
        want = _oracle(tiny_llama_dir, adapters[name])
        assert [got[i], got[i + 3]] == want[:2], name
    assert len(llm.llm_engine.list_loras()) == 3


def test_prefix_cache_never_crosses_adapters(tiny_llama_dir, adapters):
    llm = LLM(tiny_llama_dir, dtype="float32", device="cpu", kv_cache_memory=32 << 20,
              block_size=4, enable_lora=True, max_loras=2, max_lora_rank=16)
    prompt = list(range(1, 42))  # 10 full blocks of 4
    engine = llm.llm_engine

    def hits_after(lora: LoRARequest | None) -> int:
        before = engine.stats().prefix_cache_hits
        llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)
        return engine.stats().prefix_cache_hits - before

    a, b = _req(adapters, "all4", 1), _req(adapters, "qv8", 2)
    assert hits_after(a) == 0
    assert hits_after(b) == 0  # same tokens, another adapter: nothing reused
    assert hits_after(None) == 0  # nor by the base model
    assert hits_after(a) == 40  # its own 10 blocks are (hits count tokens)
    assert hits_after(None) == 40
    assert prefix_hashes(prompt, 4, "all4") != prefix_hashes(prompt, 4, "qv8")
    assert prefix_hashes(prompt, 4)[0] != prefix_hashes(prompt, 4, "all4")[0]


def test_remove_is_refused_while_a_request_uses_the_adapter(lora_llm, adapters):
    engine = lora_llm.llm_engine
    req = _req(adapters, "all4")
    engine.add_request("busy", PROMPTS[0], SamplingParams(max_tokens=4), lora_request=req)
    with pytest.raises(LoRAInUseError, match="'all4' is in use by 1 request"):
        engine.remove_lora("all4")
    while engine.has_unfinished_requests():
        engine.step()
    engine.remove_lora("all4")
    assert "all4" not in [r.lora_name for r in engine.list_loras()]
    with pytest.raises(KeyError, match="not loaded"):
        engine.remove_lora("all4")
    engine.add_lora(req)  # loads again from its path
    assert "all4" in [r.lora_name for r in engine.list_loras()]


def _bad_adapter(tmp_path, name: str, config: dict, tensors: dict[str, torch.Tensor]) -> str:
    from safetensors.torch import save_file

    folder = tmp_path / name
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return str(folder)


def test_bad_adapters_are_refused_and_change_nothing(lora_llm, adapters, tmp_path,
                                                     tiny_qwen2_dir):
    engine = lora_llm.llm_engine
    before = engine.list_loras()
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    ok = {f"{key}.lora_A.weight": torch.zeros(4, 64), f"{key}.lora_B.weight": torch.zeros(64, 4)}
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    wrong_shape = {f"{key}.lora_A.weight": torch.zeros(4, 96),
                   f"{key}.lora_B.weight": torch.zeros(64, 4)}
    cases = {
        "missing": (str(tmp_path / "nowhere"), "no adapter_config.json"),
        "rank": (_bad_adapter(tmp_path, "rank", {**cfg, "r": 32}, {
            f"{key}.lora_A.weight": torch.zeros(32, 64),
            f"{key}.lora_B.weight": torch.zeros(64, 32)}), "rank 32, above max_lora_rank 16"),
        "module": (_bad_adapter(tmp_path, "module", {**cfg, "target_modules": ["embed_tokens"]},
                                ok), r"target_modules \['embed_tokens'\] are not supported"),
        "shape": (_bad_adapter(tmp_path, "shape", cfg, wrong_shape), "maps 96 -> 64 features"),
        "layer": (_bad_adapter(tmp_path, "layer", cfg, {
            k.replace("layers.0", "layers.7"): v for k, v in ok.items()}), "has 2 layers"),
        "half": (_bad_adapter(tmp_path, "half", cfg, {f"{key}.lora_A.weight": torch.zeros(4, 64)}),
                 "has no lora_B"),
        "dora": (_bad_adapter(tmp_path, "dora", {**cfg, "use_dora": True}, ok),
                 "use_dora=True is not supported"),
    }
    for name, (path, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            engine.add_request(f"bad-{name}", PROMPTS[0], GREEDY,
                               lora_request=LoRARequest(name, 9, path))
    assert engine.list_loras() == before
    assert not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="loaded from"):  # a name already taken by another path
        engine.add_lora(LoRARequest("qv8", 2, adapters["all4"]))
    plain = LLM(tiny_qwen2_dir, dtype="float32", device="cpu", kv_cache_memory=8 << 20)
    with pytest.raises(ValueError, match="enable_lora=True"):
        plain.generate(PROMPTS[:1], GREEDY, use_tqdm=False,
                       lora_request=_req(adapters, "all4"))
    with pytest.raises(ValueError, match="2 entries for 1 prompts"):
        lora_llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=[None, None])
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "/tmp")


def test_bundled_model_with_an_adapter_matches_peft(bundled_hf_model, tmp_path, monkeypatch):
    """The bundled SmolLM2 (de-quantized to fp32 on both sides) with a rank-8 adapter. Its
    decode steps take the folded path's torch reference, as on a CPU in production: under the
    tests' TRITON_INTERPRET the Triton kernel would run interpreted at the model's sizes (four
    minutes; tests/test_lora_fold.py checks the kernel against that reference)."""
    import kernels.lora_fold

    monkeypatch.setattr(kernels.lora_fold, "INTERPRET", False)
    path = make_adapter(bundled_hf_model, tmp_path / "smol", rank=8, seed=5, scale=2.0)
    llm = LLM(None, dtype="float32", device="cpu", quantization="none", max_model_len=256,
              kv_cache_memory=16 << 20, enable_lora=True, max_lora_rank=8)
    prompts = PROMPTS[:2]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False,
                        lora_request=[LoRARequest("smol", 1, path), None])
    want_lora = _greedy(peft_model(bundled_hf_model, path), prompts[:1])
    want_base = _greedy(bundled_hf_model, prompts[1:])
    assert _tokens(outs) == want_lora + want_base
    assert want_lora != _greedy(bundled_hf_model, prompts[:1])


def test_host_cache_reloads_evicted_adapters(tiny_llama_dir, adapters):
    """max_cpu_loras=1 with two adapters in flight: both stay cached while their requests run
    (a step never reads a disk); once idle, one is evicted for another and read again from disk
    when named; outputs equal PEFT's."""
    llm = LLM(tiny_llama_dir, dtype="float32", device="cpu", kv_cache_memory=8 << 20,
              enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=16)
    engine = llm.llm_engine
    names = ["all4", "qv8"]
    loras = [_req(adapters, n, i + 1) for i, n in enumerate(names)]
    got = _tokens(llm.generate(PROMPTS[:2] * 2, GREEDY, use_tqdm=False,
                               lora_request=[loras[0], loras[0], loras[1], loras[1]]))
    for i, name in enumerate(names):
        assert got[2 * i:2 * i + 2] == _oracle(tiny_llama_dir, adapters[name])[:2], name
    assert list(engine.runner.lora.cache) == names  # both in flight together: both kept
    engine.add_lora(_req(adapters, "mlp16", 3))  # idle now: the least recent two make room
    assert list(engine.runner.lora.cache) == ["mlp16"]
    assert [r.lora_name for r in engine.list_loras()] == [*names, "mlp16"]  # all registered
    again = _tokens(llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora_request=loras[0]))
    assert again == got[:2]  # all4 read again from disk


def test_scheduler_runs_at_most_max_loras_adapters():
    from engine.block_manager import BlockManager
    from engine.config import SchedulerConfig
    from engine.request import Request
    from engine.scheduler import Scheduler

    sched = Scheduler(SchedulerConfig(max_loras=2), BlockManager(64, 4))
    reqs = [Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=2), lora_name=name)
            for i, name in enumerate(["a", "b", None, "c", "a"])]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    # "c" would be a third adapter: it waits; the base request and a second "a" do not
    assert [s.request.request_id for s in out.scheduled] == ["r0", "r1", "r2", "r4"]
    assert [r.request_id for r in sched.waiting] == ["r3"]
    assert sched.stats().running_lora_adapters == ("a", "b")
    assert sched.stats().waiting_lora_adapters == ("c",)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_mixed_batch_on_cuda_with_graphs_like_peft(tiny_llama_dir, adapters):
    """The Triton kernels inside CUDA-graphed decode steps (fp32): equal to PEFT on the CPU."""
    llm = LLM(tiny_llama_dir, dtype="float32", device="cuda", kv_cache_memory=64 << 20,
              max_num_seqs=16, enable_lora=True, max_loras=4, max_lora_rank=16)
    names = [None, "all4", "qv8", "mlp16"]
    reqs = [None if n is None else _req(adapters, n, i + 1) for i, n in enumerate(names)]
    prompts = [p for p in PROMPTS for _ in names]
    loras = [r for _ in PROMPTS for r in reqs]
    got = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
    for j, name in enumerate(names):
        want = _oracle(tiny_llama_dir, None if name is None else adapters[name])
        assert got[j::len(names)] == want, name
    graphs = llm.llm_engine.runner.graphs
    assert graphs.replays > 0 and graphs.lora_graphs and graphs.graphs
    # base-only steps replay the graphs without the LoRA kernels
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == got[0::len(names)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_decode_sizes_on_cuda_fold_the_shrink_like_peft(tiny_llama_dir, adapters):
    """Up to FOLD_MAX_TOKENS tokens a step with adapters takes the folded GEMV (the decode
    plan's kernels, norm prologue included) and the fold's expand, in CUDA graphs (fp32): one
    prompt under an adapter, and four under the base and three adapters, equal PEFT's."""
    from engine.lora.layers import FOLD_MAX_TOKENS

    llm = LLM(tiny_llama_dir, dtype="float32", device="cuda", kv_cache_memory=64 << 20,
              max_num_seqs=16, enable_lora=True, max_loras=4, max_lora_rank=16)
    names = [None, "all4", "qv8", "mlp16"]
    reqs = [None if n is None else _req(adapters, n, i + 1) for i, n in enumerate(names)]
    assert len(names) <= FOLD_MAX_TOKENS
    assert llm.llm_engine.runner.lora.modules[(0, "qkv_proj")].folded is not None
    one = _tokens(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=reqs[1]))
    assert one == _oracle(tiny_llama_dir, adapters["all4"])[:1]
    got = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=reqs))
    for j, name in enumerate(names):
        want = _oracle(tiny_llama_dir, None if name is None else adapters[name])
        assert got[j] == want[j], name


def test_tensor_parallel_lora_equals_peft(tiny_llama_dir, adapters):
    """Two ranks (gloo): column-parallel slices keep their rows of B, row-parallel ones their
    columns of A and add their delta before the all-reduce; the placements reach rank 1 over
    the step channel. max_loras=2 for three adapters: slots are reloaded on both ranks."""
    llm = LLM(tiny_llama_dir, dtype="float32", device="cpu", num_kv_blocks=64,
              tensor_parallel_size=2, enable_lora=True, max_loras=2, max_lora_rank=16,
              max_cpu_loras=2)
    try:
        names = [None, "all4", "qv8", "mlp16"]
        reqs = [None if n is None else _req(adapters, n, i + 1) for i, n in enumerate(names)]
        prompts = [p for p in PROMPTS[:2] for _ in names]
        loras = [r for _ in PROMPTS[:2] for r in reqs]
        got = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
        for j, name in enumerate(names):
            want = _oracle(tiny_llama_dir, None if name is None else adapters[name])[:2]
            assert got[j::len(names)] == want, name
    finally:
        llm.llm_engine.shutdown()
