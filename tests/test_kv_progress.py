"""The prefill role's KV progress notes (engine/kv_progress.py): with chunked prefill they come
in order, layer group by layer group, and a sender that reads every cell the moment it is noted
final ships each layer x block exactly once, with the bytes it ends with; a decode engine fed
with those bytes continues exactly like HF transformers.

The model is `tiny_llama_dir`'s with 4 layers (layer groups to note), float32, blocks of 16.
"""

from __future__ import annotations

import pytest
import torch

from engine.kv_progress import KVProgress, KVWatch
from engine.kv_transfer import KVSlab, KVSlabWriter, layout_of
from engine.llm import build_engine_config
from engine.llm_engine import LLMEngine
from pdserve import SamplingParams
from prefill_svc.frontier import SlabFrontier

BS = 16
LAYERS = 4
BUDGET = 32  # tokens per step: a 100-token prompt takes 4 chunks
GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def model(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory):
    """(model dir, HF model): `tiny_llama_dir`'s config with 4 layers."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = tmp_path_factory.mktemp("deep_llama")
    config = AutoConfig.from_pretrained(tiny_llama_dir)
    config.num_hidden_layers = LAYERS
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    hf.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_llama_dir).save_pretrained(path)
    return str(path), hf


def _engine(model, role: str, budget: int = BUDGET, **kw) -> LLMEngine:
    if "num_kv_blocks" not in kw:
        kw["kv_cache_memory"] = 64 << 20  # on a GPU: room for the other engines of the module
    return LLMEngine(build_engine_config(model[0], dtype="float32", role=role, block_size=BS,
                                         max_num_batched_tokens=budget, **kw))


class EagerSender:
    """Reads every cell the moment a note makes it final (on the engine thread, mid-forward):
    the strictest reading of the notes. A new epoch (preemption) restarts what is final."""

    def __init__(self, engine: LLMEngine, num_tokens: int):
        self.caches = engine.runner.kv_caches
        self.frontier = SlabFrontier(layout_of(self.caches), -(-num_tokens // BS), 1)
        self.notes: list[KVProgress] = []
        self.cells: dict[tuple[int, int], torch.Tensor] = {}  # (layer, block) -> [2, BS, H, D]
        self.epoch = 0

    def __call__(self, note: KVProgress) -> None:
        self.notes.append(note)
        if note.epoch != self.epoch:
            self.epoch = note.epoch
            self.frontier.restart()
        self.frontier.advance(note.num_layers, note.complete_blocks(BS))
        while (slab := self.frontier.next(flush=True)) is not None:
            layer, _, block, _ = slab  # one cell: max_bytes 1
            assert (layer, block) not in self.cells, f"cell {(layer, block)} sent twice"
            self.cells[layer, block] = self.caches[layer][:, note.block_ids[block]].clone()
            self.frontier.mark_sent(slab)

    def check_final(self, block_ids: list[int]) -> None:
        """Every cell was read once, and what was read is what the cache holds at the end."""
        assert self.frontier.complete
        assert len(self.cells) == LAYERS * len(block_ids)
        for (layer, block), cell in self.cells.items():
            assert torch.equal(cell, self.caches[layer][:, block_ids[block]]), (layer, block)


def _prefill(engine: LLMEngine, rid: str, prompt: list[int], layers_per_group: int = 1,
             run: bool = True) -> EagerSender:
    sender = EagerSender(engine, len(prompt))
    engine.add_request(rid, prompt, GREEDY, kv_watch=KVWatch(sender, layers_per_group))
    while run and engine.has_work():
        engine.step()
    return sender


def _decode(model, prompt: list[int], sender: EagerSender, first_token: int) -> list[int]:
    """The request continued on a decode engine from the cells `sender` read."""
    decode = _engine(model, "decode")
    blocks = decode.reserve_request("d", prompt, GREEDY)
    writer = KVSlabWriter(decode.runner.kv_caches, blocks.block_ids)
    for (layer, block), cell in sender.cells.items():
        writer.write(KVSlab(layer, layer + 1, block, block + 1, cell.cpu().numpy().tobytes()))
    assert writer.complete
    decode.commit_request("d", first_token, None)
    tokens = [first_token]
    while decode.has_work():
        for out in decode.step():
            tokens = out.outputs[0].token_ids if out.finished else tokens
    return tokens


def _chunk_notes(ends: list[int], group: int) -> list[tuple[int, int]]:
    """(num_layers, num_tokens) of the notes of steps ending at `ends`."""
    return [(n, end) for end in ends for n in [*range(group, LAYERS, group), LAYERS]]


@pytest.mark.parametrize("group", [1, 2])
def test_chunked_prefill_notes_come_in_order_and_ship_every_cell_once(
    model, hf_oracle, group: int
) -> None:
    prefill = _engine(model, "prefill")
    prompt = list(range(1000, 1100))  # 100 tokens: 7 blocks, the last one partly filled
    sender = _prefill(prefill, "p", prompt, group, run=False)
    outs = []
    while prefill.has_work():
        outs += prefill.step()
    assert [(n.num_layers, n.num_tokens) for n in sender.notes] == _chunk_notes(
        [32, 64, 96, 100], group)
    assert {(n.total_tokens, n.epoch) for n in sender.notes} == {(100, 0)}
    assert [n.complete_blocks(BS) for n in sender.notes if n.num_layers == LAYERS] == [2, 4, 6, 7]
    sender.check_final(prefill.held_block_ids("p"))
    first = outs[-1].outputs[0].token_ids[0]
    assert prefill.release("p") and not prefill._kv_watches
    expected = hf_oracle(model[1], [prompt], GREEDY.max_tokens, prefill.eos_token_ids)[0]
    assert _decode(model, prompt, sender, first) == expected


def test_prefix_cache_hits_are_final_from_the_start(model) -> None:
    prefill = _engine(model, "prefill")
    prompt = list(range(2000, 2100))
    _prefill(prefill, "first", prompt)
    assert prefill.release("first")  # its 6 full blocks stay in the prefix cache
    sender = _prefill(prefill, "again", prompt + list(range(3000, 3020)))
    notes = [(n.num_layers, n.num_tokens) for n in sender.notes]
    assert notes == [(LAYERS, 96), *_chunk_notes([120], 1)]  # 96 cached, then [96, 120)
    sender.check_final(prefill.held_block_ids("again"))
    assert prefill.release("again")


def test_a_preempted_request_is_noted_again_from_a_new_epoch(model) -> None:
    """8 blocks: "a" (80 tokens, 5 blocks) and "b" (60 tokens, 4 blocks) cannot both be held.
    Step 1 computes a[0, 64); step 2 a[64, 80) (a held, 5 blocks) and b[0, 48) (3 blocks);
    step 3 finds no block for b[48, 60): b is preempted, its earlier notes stale. Once a is
    released, b comes back (its 3 full blocks hit the prefix cache) and is noted anew."""
    prefill = _engine(model, "prefill", budget=64, num_kv_blocks=8, max_model_len=128)
    a = _prefill(prefill, "a", list(range(4000, 4080)), run=False)
    b = _prefill(prefill, "b", list(range(5000, 5060)), run=False)
    for _ in range(3):
        prefill.step()
    assert prefill.scheduler.num_preemptions == 1 and "a" in prefill.scheduler.held
    a.check_final(prefill.held_block_ids("a"))
    assert prefill.release("a")
    while prefill.has_work():
        prefill.step()
    notes = [(n.num_layers, n.num_tokens, n.epoch) for n in b.notes]
    assert notes == [
        *((n, 48, 0) for n in range(1, LAYERS + 1)),  # step 2
        (LAYERS, 48, 1),  # back: 3 blocks from the prefix cache
        *((n, 60, 1) for n in range(1, LAYERS + 1)),
    ]
    b.check_final(prefill.held_block_ids("b"))
    assert prefill.release("b")
    assert prefill.block_manager.num_free_blocks == 8


async def test_the_async_engine_hands_the_notes_to_the_loop_before_the_first_token(
    model,
) -> None:
    from engine.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine(_engine(model, "prefill"))
    try:
        notes: list[KVProgress] = []
        watch = engine.watch_kv(notes.append, layers_per_group=2)
        seen = []
        async for out in engine.generate(list(range(1000, 1100)), GREEDY, "a", kv_watch=watch):
            seen.append((len(notes), out.finished))
        assert seen == [(8, True)]  # every note was on the loop before the output
        assert [(n.num_layers, n.num_tokens) for n in notes] == _chunk_notes(
            [32, 64, 96, 100], 2)
        assert await engine.call(engine.engine.release, "a")
    finally:
        engine.shutdown()


def test_only_a_prefill_request_can_be_watched(model) -> None:
    colocated = _engine(model, "colocated")
    with pytest.raises(ValueError, match="prefill-role request with n = 1"):
        colocated.add_request("x", [5, 6, 7], GREEDY, kv_watch=KVWatch(print))
    prefill = _engine(model, "prefill")
    with pytest.raises(ValueError, match="prefill-role request with n = 1"):
        prefill.add_request("x", [5, 6, 7], SamplingParams(n=2), kv_watch=KVWatch(print))
    assert not prefill.has_unfinished_requests()


def test_an_aborted_request_makes_its_notes_stale(model) -> None:
    prefill = _engine(model, "prefill")
    notes: list[KVProgress] = []
    watch = KVWatch(notes.append)
    prefill.add_request("gone", list(range(100)), GREEDY, kv_watch=watch)
    prefill.step()  # one chunk of 32
    assert notes and watch.epoch == 0
    assert prefill.abort_request("gone")
    assert watch.epoch == 1 and not prefill._kv_watches  # a reader now skips its blocks
    with watch.reading(0) as current:
        assert not current


def test_notes_of_one_moment_reach_an_event_loop_in_one_hop() -> None:
    """Watches on an event loop get their notes there, in order, one call_soon_threadsafe per
    loop; a watch without a loop gets its note at once on the engine thread."""
    import asyncio
    import threading

    from engine.kv_progress import KVProgress, KVWatch, deliver

    async def run() -> None:
        loop = asyncio.get_running_loop()
        hops, seen, direct = [], [], []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: hops.append(a) or real(*a)
        a = KVWatch(lambda note: seen.append(("a", note.num_layers)), loop=loop)
        b = KVWatch(lambda note: seen.append(("b", note.num_layers)), loop=loop)
        c = KVWatch(lambda note: direct.append(threading.current_thread().name))
        notes = [(w, KVProgress(n, 16, 16, (0,), 0))
                 for w, n in ((a, 1), (b, 1), (c, 1), (a, 2))]
        await asyncio.to_thread(deliver, notes)
        await asyncio.sleep(0)
        mine = [h for h in hops if getattr(h[0], "__name__", "") == "_run_all"]
        assert seen == [("a", 1), ("b", 1), ("a", 2)] and len(mine) == 1  # (to_thread's own)
        assert direct and direct[0] != threading.current_thread().name  # the engine's thread

    asyncio.run(run())
