"""`merge_sequences`: a sequence's outputs that wait together leave as one (what a gateway
behind its clients does), outputs that come apart leave apart, and nothing is lost or
reordered within a sequence."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest

from gateway.backend import TokenLogprobs
from gateway.sequence import SequenceOutput, merge_sequences


async def _burst(index: int, count: int, pause_s: float = 0.0
                 ) -> AsyncGenerator[SequenceOutput, None]:
    """`count` outputs of one token each, the last finished; `pause_s` apart (0: back to back,
    never suspending between them)."""
    for i in range(count):
        if pause_s and i:
            await asyncio.sleep(pause_s)
        last = i == count - 1
        yield SequenceOutput(index, f"<{index}.{i}>", [100 * index + i],
                             finish_reason="length" if last else None,
                             num_cached_tokens=16 if i == 0 else None)


async def _collect(streams: list[AsyncGenerator[SequenceOutput, None]]) -> list[SequenceOutput]:
    return [out async for out in merge_sequences(streams)]


def test_outputs_waiting_together_leave_as_one():
    outs = asyncio.run(_collect([_burst(0, 5), _burst(1, 3)]))
    assert len(outs) == 2
    by_index = {o.index: o for o in outs}
    assert by_index[0].text == "".join(f"<0.{i}>" for i in range(5))
    assert by_index[0].token_ids == [0, 1, 2, 3, 4]
    assert by_index[1].token_ids == [100, 101, 102]
    assert all(o.finish_reason == "length" and o.num_cached_tokens == 16 for o in outs)


def test_outputs_coming_apart_leave_apart():
    outs = asyncio.run(_collect([_burst(0, 4, pause_s=0.01)]))
    assert [o.token_ids for o in outs] == [[0], [1], [2], [3]]
    assert [o.finish_reason for o in outs] == [None, None, None, "length"]
    assert outs[0].num_cached_tokens == 16 and outs[1].num_cached_tokens is None


def test_outputs_taken_before_a_failure_still_leave():
    async def failing() -> AsyncGenerator[SequenceOutput, None]:
        yield SequenceOutput(0, "a", [1])
        yield SequenceOutput(0, "b", [2])
        raise RuntimeError("worker lost")

    async def run() -> tuple[list[SequenceOutput], BaseException | None]:
        got: list[SequenceOutput] = []
        try:
            async for out in merge_sequences([failing()]):
                got.append(out)
        except RuntimeError as exc:
            return got, exc
        return got, None

    got, exc = asyncio.run(run())
    assert str(exc) == "worker lost"
    assert [(o.text, o.token_ids) for o in got] == [("ab", [1, 2])]


def test_joined_keeps_every_field():
    lp: list[TokenLogprobs] = [(-0.5, {5: -0.5})]
    a = SequenceOutput(2, "x", [5], lp, prompt_logprobs=[None], num_cached_tokens=32)
    b = SequenceOutput(2, "y", [6], [(-1.0, {6: -1.0})], "stop", "END")
    c = a.joined(b)
    assert (c.index, c.text, c.token_ids) == (2, "xy", [5, 6])
    assert c.logprobs == [(-0.5, {5: -0.5}), (-1.0, {6: -1.0})]
    assert (c.finish_reason, c.stop_reason) == ("stop", "END")
    assert (c.prompt_logprobs, c.num_cached_tokens) == ([None], 32)
    assert a.joined(SequenceOutput(2, "", [])).logprobs == lp
    plain = SequenceOutput(0, "p", [1]).joined(SequenceOutput(0, "q", [2]))
    assert plain.logprobs is None


@pytest.mark.parametrize("n", [1, 3])
def test_nothing_lost_or_reordered_within_a_sequence(n):
    async def run() -> list[SequenceOutput]:
        streams = [_burst(i, 20, pause_s=0.001 * (i % 2)) for i in range(n)]
        return await _collect(streams)

    outs = asyncio.run(run())
    for i in range(n):
        mine = [o for o in outs if o.index == i]
        assert [t for o in mine for t in o.token_ids] == [100 * i + k for k in range(20)]
        assert "".join(o.text for o in mine) == "".join(f"<{i}.{k}>" for k in range(20))
        assert [o.finish_reason for o in mine][-1] == "length"
        assert all(o.finish_reason is None for o in mine[:-1])
