"""Disaggregation inside one process (tests/disagg_harness.py): a prefill-role engine exports KV,
a decode-role engine imports it and continues; the tokens equal the colocated engine's, token
for token."""

from __future__ import annotations

import pytest
from disagg_harness import colocated_and_disaggregated, disaggregated, pd_engines, run_all

from engine.kv_handoff import KVCacheFullError
from engine.kv_transfer import KVLayout, KVSlab, KVSlabWriter, plan_slabs
from pdserve import SamplingParams


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    return pd_engines(tiny_llama_dir)


@pytest.mark.parametrize("max_bytes", [4 << 20, 3000])  # whole layers per slab; block pieces
def test_disaggregated_equals_colocated(engines, max_bytes):
    expected, decoded = colocated_and_disaggregated(*engines, max_bytes)
    decode = engines[2]
    # decode outputs repeat the imported first token; drop the duplicate
    assert [d[:1] + d[2:] for d in decoded] == expected
    assert decode.block_manager.num_free_blocks == decode.block_manager.num_blocks


def test_seeded_sampling_continues_across_workers(engines):
    colocated, prefill, decode = engines
    prompt = colocated.tokenizer.encode("Seeded sampling must not repeat its first draw")
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=99, ignore_eos=True)
    colocated.add_request("s", prompt, params)
    expected = run_all(colocated)["s"].outputs[0].token_ids
    got = disaggregated(prefill, decode, [prompt], params)[0]
    assert got[:1] + got[2:] == expected


def test_reserve_fails_cleanly_when_full(engines):
    _, _, decode = engines
    assert decode.block_manager.num_free_blocks == 40
    decode.reserve_request("big", list(range(10, 410)), SamplingParams(max_tokens=1))  # 25 blocks
    with pytest.raises(KVCacheFullError, match="15 KV blocks free"):
        decode.reserve_request("next", list(range(10, 310)), SamplingParams(max_tokens=1))
    assert decode.block_manager.num_free_blocks == 15
    decode.abort_request("big")
    assert decode.block_manager.num_free_blocks == 40
    assert not decode.has_unfinished_requests()


def test_abort_while_waiting_for_kv_frees_reserved_blocks(engines):
    _, prefill, decode = engines
    free = decode.block_manager.num_free_blocks
    decode.reserve_request("gone", list(range(10, 60)), SamplingParams(max_tokens=4))
    assert decode.block_manager.num_free_blocks == free - 4
    assert decode.stats().num_waiting == 1
    assert decode.abort_request("gone")
    assert decode.block_manager.num_free_blocks == free and decode.stats().num_waiting == 0
    prefill.add_request("held", list(range(10, 60)), SamplingParams(max_tokens=4))
    run_all(prefill)
    assert prefill.block_manager.num_free_blocks < prefill.block_manager.num_blocks
    assert prefill.abort_request("held")  # e.g. the decode worker died mid-transfer
    assert prefill.block_manager.num_free_blocks == prefill.block_manager.num_blocks


def test_writer_rejects_bad_slabs(engines):
    _, _, decode = engines
    blocks = decode.reserve_request("bad", list(range(10, 42)), SamplingParams(max_tokens=2))
    writer = KVSlabWriter(decode.runner.kv_caches, blocks.block_ids)
    cell = writer.layout.cell_bytes()
    with pytest.raises(ValueError, match="bytes"):
        writer.write(KVSlab(0, 1, 0, 2, b"\0" * (2 * cell - 1)))
    with pytest.raises(ValueError, match="range"):
        writer.write(KVSlab(0, 9, 0, 1, b"\0" * cell))
    writer.write(KVSlab(0, 1, 0, 1, b"\0" * cell))
    with pytest.raises(ValueError, match="overlaps"):
        writer.write(KVSlab(0, 1, 0, 2, b"\0" * 2 * cell))
    assert not writer.complete and writer.bytes_received == cell
    decode.abort_request("bad")


def test_layout_check_names_the_mismatch():
    mine = KVLayout(30, 3, 64, "float32", 16)
    with pytest.raises(ValueError, match="num_kv_heads: sender 4 != receiver 3"):
        mine.check_compatible(KVLayout(30, 4, 64, "float32", 16))
    mine.check_compatible(KVLayout(30, 3, 64, "float32", 16))


def test_slab_plan_covers_every_cell_once():
    layout = KVLayout(5, 2, 8, "float32", 16)  # cell = 2 * 16 * 2 * 8 * 4 = 2048 bytes
    for max_bytes in (1, 2048, 5000, 3 * 2048 * 7, 10**9):
        seen = set()
        for l0, l1, b0, b1 in plan_slabs(layout, 7, max_bytes):
            assert (l1 - l0) * (b1 - b0) * 2048 <= max(max_bytes, 2048)
            cells = {(layer, b) for layer in range(l0, l1) for b in range(b0, b1)}
            assert not cells & seen
            seen |= cells
        assert len(seen) == 5 * 7


def test_second_turn_reuses_the_decode_workers_prefix(engines):
    """Turn 2 resends turn 1's prompt and answer: the decode engine's prefix cache holds their
    full blocks, so the reservation shares them and only the rest is written; the tokens
    still equal colocated."""
    colocated, prefill, decode = engines
    tok = colocated.tokenizer
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    turn1 = tok.encode("The first turn of a conversation that spans a few blocks of tokens " * 3)
    answer = disaggregated(prefill, decode, [turn1], params)[0]
    turn2 = turn1 + answer[:1] + answer[2:] + tok.encode(" And the follow-up question?")
    colocated.add_request("t2", turn2, params)
    expected = run_all(colocated)["t2"].outputs[0].token_ids
    queried = decode.block_manager.prefix_cache_hits
    bs = decode.block_manager.block_size
    held = decode.reserve_request("peek", turn2, params)
    # turn 1 and the 7 answer tokens fed back (the 8th was only sampled): their full blocks
    assert held.num_cached_blocks == (len(turn1) + 7) // bs > 0
    assert decode.block_manager.prefix_cache_hits - queried == bs * held.num_cached_blocks
    decode.abort_request("peek")
    got = disaggregated(prefill, decode, [turn2], params)[0]
    assert got[:1] + got[2:] == expected
    assert decode.block_manager.num_free_blocks == decode.block_manager.num_blocks


def test_a_prefix_evicted_before_the_reservation_is_pushed_whole(engines):
    """Held blocks cannot be evicted (the reservation holds them); a prefix evicted before the
    reservation is simply not held: the whole KV is pushed, and the tokens still equal
    colocated."""
    colocated, prefill, decode = engines
    tok = colocated.tokenizer
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    turn1 = tok.encode("A history the decode worker will have to forget again " * 3)
    disaggregated(prefill, decode, [turn1], params)
    for i in range(2):  # other requests take all 40 blocks: turn 1's cached ones too
        decode.reserve_request(f"fill{i}", list(range(1000 + 400 * i, 1000 + 400 * i + 319)),
                               SamplingParams(max_tokens=1))
    assert decode.block_manager.num_free_blocks == 0
    for i in range(2):
        decode.abort_request(f"fill{i}")
    turn2 = turn1 + tok.encode(" and more")
    assert decode.reserve_request("peek", turn2, params).num_cached_blocks == 0
    decode.abort_request("peek")
    colocated.add_request("t2", turn2, params)
    expected = run_all(colocated)["t2"].outputs[0].token_ids
    got = disaggregated(prefill, decode, [turn2], params)[0]
    assert got[:1] + got[2:] == expected
