"""Resumable streams: the event log in a real redis-server, a decoder primed with a sequence's
prior tokens, a colocated gateway whose logs are cut short by hand (and one tailed live), and a
live cluster with two gateways: one killed mid-stream, a client that hangs up.

A resumed stream must be the uninterrupted one: the same events after the client's last id (no
gap, no repeat), the same text and tokens, the usage chunk and [DONE]; its request state ends
`finished` with `resumes` counted, and no worker keeps anything.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import threading
import time
from collections.abc import AsyncGenerator, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import uvicorn
from cluster import Cluster, extra_gateway, http_get, run_cluster
from fake_backend import FakeBackend
from fastapi.testclient import TestClient
from live_checks import metric, wait_idle

from engine.async_engine import AsyncLLMEngine
from engine.sampling_params import SamplingParams
from gateway.app import build_app
from gateway.backend import TokenDelta, resumed_request_id, state_request_id
from gateway.local_backend import LocalBackend
from gateway.recorder import StreamRecorder, decode_outputs
from gateway.sequence import SequenceDecoder, SequenceOutput, SequenceSpec
from pdserve.cluster.event_log import EventLog, LogEvent, StreamMeta
from pdserve.cluster.state import (
    InvalidTransition,
    Keys,
    RequestNotFound,
    RequestStore,
    StateStoreError,
    connect,
)
from pdserve.ports import free_port

PREFIX = "resume-test"  # the in-process gateway's keys, apart from other tests' on one Redis
PROMPT = "Resume me: a prompt long enough to span more than one block of sixteen tokens each"
CHAT = [{"role": "user", "content": "Tell me a story about a dragon."}]
Events = list[tuple[int, str]]  # (id, data) of each SSE event


# ---- the event log and the request state in Redis ------------------------------------------
async def test_event_log_round_trip(redis_url: str) -> None:
    client = connect(redis_url)
    log, keys = EventLog(client, PREFIX, ttl_s=60, lease_ms=2000), Keys(PREFIX)
    try:
        assert await log.append("r1", "me", [], spec='{"kind": "x"}')  # opens the log
        assert await log.meta("r1") == StreamMeta('{"kind": "x"}', False)
        events = [LogEvent(i, f"data: {i}\n\n", f"[{i}]") for i in range(3)]
        assert await log.append("r1", "me", events[:2])
        assert await log.append("r1", "me", events[2:])
        assert await log.read("r1") == events
        assert await log.read("r1", 0) == events[1:]
        assert await log.read("r1", 2) == []
        # a blocked read wakes on the next append
        waiting = asyncio.create_task(log.read("r1", 2, block_ms=3000))
        await asyncio.sleep(0.1)
        assert await log.append("r1", "me", [LogEvent(3, "data: 3\n\n")])
        assert await asyncio.wait_for(waiting, 1) == [LogEvent(3, "data: 3\n\n")]
        # only the lease holder writes
        assert not await log.acquire("r1", "other")
        assert not await log.append("r1", "other", [LogEvent(4, "data: x\n\n")])
        assert await log.read("r1", 3) == []
        # the end: done, the lease dropped, the keys kept for the TTL
        assert await log.append("r1", "me", [LogEvent(4, "data: [DONE]\n\n")], end="done")
        assert await log.meta("r1") == StreamMeta('{"kind": "x"}', True)
        assert not await client.exists(keys.owner("r1"))
        for key in (keys.stream("r1"), keys.events("r1")):
            assert 55 <= await client.ttl(key) <= 60
        assert await log.meta("unknown") is None
    finally:
        await client.aclose()


async def test_event_log_lease(redis_url: str) -> None:
    client = connect(redis_url)
    log = EventLog(client, PREFIX, ttl_s=60, lease_ms=300)
    try:
        assert await log.append("r2", "a", [], spec="{}")
        await log.release("r2", "b")  # not b's to give up
        assert not await log.acquire("r2", "c")
        assert await log.append("r2", "a", [], end="release")
        assert await log.acquire("r2", "c")
        await asyncio.sleep(0.4)  # c stopped renewing: its lease ran out
        assert await log.acquire("r2", "d")
        assert not await log.append("r2", "c", [])
    finally:
        await client.aclose()


async def test_event_log_appends_made_meanwhile_go_in_one_call(redis_url: str) -> None:
    """Group commit: appends made while a call is in flight go together in the next; each
    stream's lease is checked alone; a Redis failure reaches every waiting caller."""
    client = connect(redis_url)
    log = EventLog(client, PREFIX, ttl_s=60, lease_ms=2000)
    calls: list[int] = []
    script = log.writer._script

    async def counted(args: list) -> Any:
        calls.append(len(json.loads(args[2])))  # streams in the call
        return await script(args=args)

    try:
        await asyncio.gather(*(log.append(f"g{i}", "me", [], spec="{}") for i in range(5)))
        log.writer._script = counted  # type: ignore[assignment]  # the calls after the opens
        first = asyncio.create_task(log.append("g0", "me", [LogEvent(0, "data: a\n\n")]))
        await asyncio.sleep(0)  # its call is in flight: the next ones wait for it
        rest = [log.append(f"g{i}", "me" if i != 3 else "thief", [LogEvent(0, f"data: {i}\n\n")],
                           end="done" if i == 4 else "") for i in range(1, 5)]
        assert await first
        assert await asyncio.gather(*rest) == [True, True, False, True]
        assert calls == [1, 4]
        assert [e.data for e in await log.read("g2")] == ["data: 2\n\n"]
        assert await log.read("g3") == []  # not the lease holder's: nothing written
        assert (await log.meta("g4")).done and not (await log.meta("g1")).done
        # a caller cancelled while its append waits for the next call: the others go on
        busy = asyncio.create_task(log.append("g0", "me", [LogEvent(1, "data: b\n\n")]))
        await asyncio.sleep(0)
        gone = asyncio.create_task(log.append("g1", "me", [LogEvent(1, "data: c\n\n")]))
        kept = asyncio.create_task(log.append("g2", "me", [LogEvent(1, "data: d\n\n")]))
        await asyncio.sleep(0)
        gone.cancel()
        assert await busy and await kept
        assert gone.cancelled()
        assert [e.data for e in await log.read("g2")] == ["data: 2\n\n", "data: d\n\n"]
    finally:
        await client.aclose()
    broken = EventLog(connect("redis://127.0.0.1:1/0", timeout_s=0.5), PREFIX)
    results = await asyncio.gather(*(broken.append(f"x{i}", "me", []) for i in range(3)),
                                   return_exceptions=True)
    assert all(isinstance(r, StateStoreError) for r in results)


async def test_log_writer_opens_joins_and_renews(redis_url: str) -> None:
    """A stream's submits before the next call join one entry (the first opens the log); a
    quiet stream keeps its lease (renewed by the writer) until its end drops it; another
    owner's submit never joins."""
    client = connect(redis_url)
    log, keys = EventLog(client, PREFIX, ttl_s=60, lease_ms=300), Keys(PREFIX)
    # the writes travel as one JSON argument: text beyond ASCII and quotes come back as sent
    events = [LogEvent(i, f'data: {{"text": "é 😀 中 \\"{i}\\""}}\n\n', f'[[0, [{i}], "😀"]]')
              for i in range(3)]
    try:
        first = log.submit("w1", "me", events[:1], spec='{"k": "😀"}')
        assert log.submit("w1", "me", events[1:2]) is first
        assert await first
        assert await log.meta("w1") == StreamMeta('{"k": "😀"}', False)
        assert await log.read("w1") == events[:2]
        await asyncio.sleep(0.5)  # longer than the lease: renewed meanwhile
        assert await client.get(keys.owner("w1")) == "me"
        assert await log.append("w1", "me", events[2:], end="done")
        assert await log.read("w1") == events and (await log.meta("w1")).done
        assert not await client.exists(keys.owner("w1"))
        await asyncio.sleep(0.05)
        assert log.writer._task is not None and log.writer._task.done()  # nothing held
        mine = log.submit("w2", "a", events[:1], spec="{}")
        theirs = log.submit("w2", "b", events[1:2])
        assert theirs is not mine and await mine and not await theirs
        assert await log.read("w2") == events[:1]
        assert await log.append("w2", "a", [], end="release")
    finally:
        await client.aclose()


async def test_log_writer_calls_an_interval_apart(redis_url: str) -> None:
    """With an interval, what is submitted meanwhile waits for it and goes in one call; a
    stream's end does not wait (its client's response does)."""
    client = connect(redis_url)
    log = EventLog(client, PREFIX, ttl_s=60, lease_ms=3000, write_interval_s=0.2)
    starts: list[tuple[float, int]] = []
    script = log.writer._script

    async def timed(args: list) -> Any:
        starts.append((time.monotonic(), len(json.loads(args[2]))))
        return await script(args=args)

    log.writer._script = timed  # type: ignore[assignment]
    try:
        assert await log.submit("i0", "me", [LogEvent(0, "data: 0\n\n")], spec="{}")
        later = [log.submit(f"i{i}", "me", [LogEvent(0, f"data: {i}\n\n")], spec="{}")
                 for i in (1, 2)]
        assert await asyncio.gather(*later) == [True, True]
        assert [n for _, n in starts] == [1, 2]
        assert starts[1][0] - starts[0][0] >= 0.19
        assert await log.append("i0", "me", [], end="done")
        assert starts[2][0] - starts[1][0] < 0.1
        for i in (1, 2):
            assert await log.append(f"i{i}", "me", [], end="done")
    finally:
        await client.aclose()


async def test_a_recorder_whose_lease_is_taken_stops_recording(redis_url: str) -> None:
    """Another gateway took the stream over: this one's stream goes on to its client, and
    nothing more of it reaches the log (not even its end)."""
    client = connect(redis_url)
    log, keys = EventLog(client, PREFIX, ttl_s=60, lease_ms=3000), Keys(PREFIX)

    async def events() -> AsyncGenerator[str, None]:
        for i in range(4):
            yield f"data: {i}\n\n"
            await asyncio.sleep(0.05)  # each event's write is back before the next
            if i == 0:
                await client.set(keys.owner("t1"), "thief")

    try:
        recorder = StreamRecorder(log, "t1", spec="{}")
        sent = [text async for text in recorder.record(events())]
        assert sent == [f"id: {i}\ndata: {i}\n\n" for i in range(4)]
        assert [e.id for e in await log.read("t1")] == [0]
        assert not (await log.meta("t1")).done
        assert await client.get(keys.owner("t1")) == "thief"
    finally:
        await client.aclose()


async def test_a_joined_output_is_sent_once_logged(redis_url: str) -> None:
    """An event rendered from joined outputs leaves only once the log holds it (a take-over
    could not render its bounds again), at once rather than after the writer's interval;
    other events leave without waiting. Nothing joins into an event the client has."""
    client = connect(redis_url)
    log = EventLog(client, PREFIX, ttl_s=60, lease_ms=6000, write_interval_s=1.0)
    outputs = [SequenceOutput(0, "a", [1]), SequenceOutput(0, "b", [2]),
               SequenceOutput(0, "cd", [3, 4], parts=2), SequenceOutput(0, "e", [5])]

    async def source() -> AsyncGenerator[SequenceOutput, None]:
        for out in outputs:
            yield out

    try:
        recorder = StreamRecorder(log, "j1", spec="{}")
        tapped = recorder.tap(source())

        async def events() -> AsyncGenerator[str, None]:
            async for out in tapped:
                yield f"data: {out.text}\n\n"

        logged_when_sent = []
        start = asyncio.get_running_loop().time()
        async for text in recorder.record(events()):
            logged_when_sent.append(len(await log.read("j1")))
            if text.startswith("id: 2"):
                waited = asyncio.get_running_loop().time() - start
        # events 0 and 1 went without waiting for their writes (the writer's first call, at
        # once, may have logged event 0 by the time the log is read; event 1's is an interval
        # away), 2 once it and those before it were logged, 3 without waiting (not logged:
        # the writer's next call is an interval away)
        assert max(logged_when_sent[:2]) <= 1
        assert logged_when_sent[2:] == [3, 3]
        assert waited < 0.9  # not the writer's 1 s interval
        assert [e.id for e in await log.read("j1")] == [0, 1, 2, 3]  # the end is written
    finally:
        await client.aclose()
    taken = StreamRecorder(log, "j2", owner="me", next_id=3)
    taken._after = 5  # the client has events up to 5: they are generated again, unjoined
    assert not taken.may_join()
    taken.next_id = 6
    assert taken.may_join()


async def test_request_state_resume(redis_url: str) -> None:
    client = connect(redis_url)
    store = RequestStore(client, PREFIX, ttl_s=60)
    try:
        await store.create("q", model="m", prompt_tokens=3, stream=True)
        await store.transition("q", "decoding")
        await store.transition("q", "cancelled")  # its client left
        assert await store.resume("q") == 1
        state = await store.get("q")
        assert state is not None and state["status"] == "queued" and state["resumes"] == "1"
        assert "ts_resumed" in state
        for status in ("prefilling", "decoding", "finished"):
            await store.transition("q", status)
        with pytest.raises(InvalidTransition):
            await store.resume("q")
        with pytest.raises(RequestNotFound):
            await store.resume("nothing")
    finally:
        await client.aclose()


# ---- the pieces: backend ids, a primed decoder -----------------------------------------------
def test_a_resumed_sequence_speaks_for_its_request_as_before() -> None:
    """Sequence 0 of a request moves its state, resumed or not; the other sequences do not."""
    for backend_id, state_id in [("cmpl-ab", "cmpl-ab"), ("cmpl-ab-0", "cmpl-ab"),
                                 ("cmpl-ab-3", None)]:
        assert state_request_id(backend_id) == state_id
        assert state_request_id(resumed_request_id(backend_id, "9f0c")) == state_id


TEXT = "Café ☕ naïve — 日本語のテキスト, then a STOP and more words after it"


@pytest.mark.parametrize("stop", [None, ["STOP"], ["テキ"]])
def test_a_decoder_primed_with_prior_tokens_continues_the_text(bundled_tokenizer, stop) -> None:
    """Cut anywhere (inside a character's bytes, inside a stop string), a decoder primed with
    the tokens before the cut gives the text the uninterrupted one gave after it."""
    ids = bundled_tokenizer.encode(TEXT, add_special_tokens=False)
    prompt = bundled_tokenizer.encode("Say:")
    params = SamplingParams(max_tokens=len(ids), stop=stop)

    def deltas(tokens: list[int], size: int) -> list[TokenDelta]:
        out = [TokenDelta(tokens[i:i + size]) for i in range(0, len(tokens), size)]
        out[-1].finish_reason = "length"
        return out

    whole = SequenceDecoder(bundled_tokenizer, SequenceSpec(0, "r", prompt, params))
    outs = [whole.decode(d) for d in deltas(ids, 1)]
    end = next(i for i, o in enumerate(outs) if o.finished)
    full = "".join(o.text for o in outs[: end + 1])
    assert full == (TEXT if stop is None else TEXT[: TEXT.index(stop[0])])
    for k in range(1, end + 1):
        spec = SequenceSpec(0, "r.x", prompt, params, prior_token_ids=ids[:k])
        primed = SequenceDecoder(bundled_tokenizer, spec)
        rest = []
        for d in deltas(ids[k:], 3):
            rest.append(primed.decode(d))
            if rest[-1].finished:
                break
        assert "".join(o.text for o in outs[:k]) + "".join(o.text for o in rest) == full, k
        assert (rest[-1].finish_reason, rest[-1].stop_reason) == (outs[end].finish_reason,
                                                                  outs[end].stop_reason)


# ---- a colocated gateway on Redis: logs cut short by hand ----------------------------------
@contextmanager
def serve(app: Any) -> Iterator[str]:
    """uvicorn serving `app` on a free loopback port, in a thread."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def local_url(tiny_llama_dir: str, redis_url: str) -> Iterator[str]:
    engine = AsyncLLMEngine.from_args(tiny_llama_dir, dtype="float32")
    client = connect(redis_url)  # first used in the server's event loop
    app = build_app(LocalBackend(engine, "tiny"), store=RequestStore(client, PREFIX),
                    events=EventLog(client, PREFIX, ttl_s=120))
    with serve(app) as url:
        yield url
    engine.shutdown()


def parse_sse(text: str) -> Events:
    events = []
    for block in filter(None, text.split("\n\n")):
        fields = dict(line.split(": ", 1) for line in block.split("\n"))
        events.append((int(fields["id"]), fields["data"]))
    return events


def same(a: Any, b: Any) -> bool:
    """Equal, but for float drift (logprobs of re-prefilled tokens) and the prompt's cache hits
    (a choice generated again from its start finds the prompt cached by the first stream)."""
    if isinstance(a, dict) and "prompt_tokens_details" in a:
        a, b = _without_hits(a), _without_hits(b)
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, abs_tol=1e-3)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def _without_hits(usage: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in usage.items() if k != "prompt_tokens_details"}


def choices_content(events: Events) -> list[Any]:
    """Each choice's text (completions) or role and content (chat), finish and logprobs (one
    record a token), and the usage: what a stream says, whatever the order its choices' chunks
    came in and however its tokens fell into chunks. Compare two with `same`."""
    chunks = [json.loads(d) for _, d in events if d != "[DONE]"]
    content: dict[int, list[Any]] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            entry = content.setdefault(c["index"], ["", None, None, None, []])
            entry[0] += c["text"] if "text" in c else c["delta"].get("content") or ""
            entry[1] = entry[1] or c.get("delta", {}).get("role")
            if c["finish_reason"]:
                entry[2:4] = [c["finish_reason"], c["stop_reason"]]
            entry[4] += _token_logprobs(c.get("logprobs"))
    usage = chunks[-1].get("usage")
    return [content, usage if usage is None else _without_hits(usage)]


def _token_logprobs(logprobs: dict[str, Any] | None) -> list[Any]:
    """A chunk's logprobs, one record a token: chat's `content` entries, or the completions
    shape's parallel lists zipped."""
    if not logprobs:
        return []
    if "content" in logprobs:
        return list(logprobs["content"] or [])
    return [list(t) for t in zip(logprobs["tokens"], logprobs["token_logprobs"],
                                 logprobs["top_logprobs"], logprobs["text_offset"], strict=True)]


def log_entries(redis_url: str, request_id: str) -> list[LogEvent]:
    """The stream's log as it is now."""
    async def read(client: Any, keys: Keys) -> list[LogEvent]:
        return await EventLog(client, PREFIX).read(request_id)

    return redis_run(redis_url, read)


def logged_events(redis_url: str, request_id: str, entries: list[LogEvent] | None = None
                  ) -> Events:
    """The stream's events as its log holds them (or `entries` read from it): (id, data) as
    `parse_sse` gives them."""
    if entries is None:
        entries = log_entries(redis_url, request_id)
    return parse_sse("".join(f"id: {e.id}\n{e.data}" for e in entries))


def redis_run(redis_url: str, fn: Any) -> Any:
    async def go() -> Any:
        client = connect(redis_url)
        try:
            return await fn(client, Keys(PREFIX))
        finally:
            await client.aclose()

    return asyncio.run(go())


def unjoined_run(entries: list[LogEvent], length: int) -> int:
    """The first event id from which `length` of a log's `entries` each rendered one output of
    one token (none joined: the only events a dead gateway may have sent and not logged)."""
    single = [len(outs) == 1 and len(outs[0].token_ids) == 1
              for outs in (decode_outputs(e.out) for e in entries)]
    for start in range(1, len(single) - length):
        if all(single[start:start + length]):
            return start
    raise AssertionError(f"no {length} events of one output each in {single}")


def cut_log(redis_url: str, request_id: str, keep: int) -> None:
    """As if the gateway died after logging `keep` events of a stream it was generating."""
    async def cut(client: Any, keys: Keys) -> None:
        entries = (await client.xrange(keys.events(request_id)))[:keep]
        await client.delete(keys.events(request_id), keys.owner(request_id))
        for entry_id, fields in entries:
            await client.xadd(keys.events(request_id), fields, id=entry_id)
        await client.hdel(keys.stream(request_id), "done")
        await client.hset(keys.request(request_id), "status", "decoding")

    redis_run(redis_url, cut)


CASES = {
    "completion": ("/v1/completions", {
        "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
        "stream_options": {"include_usage": True}}),
    "completions-batch-n2-echo-seeded": ("/v1/completions", {
        "prompt": [PROMPT, "Another one"], "n": 2, "max_tokens": 12, "temperature": 0.8,
        "seed": 3, "ignore_eos": True, "echo": True, "stream_options": {"include_usage": True}}),
    "chat-n2": ("/v1/chat/completions", {
        "messages": CHAT, "n": 2, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
        "stream_options": {"include_usage": True}}),
    "chat-logprobs": ("/v1/chat/completions", {
        "messages": CHAT, "max_tokens": 32, "temperature": 0, "ignore_eos": True,
        "logprobs": True, "top_logprobs": 2}),  # long enough for 3 unjoined events under load
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES)
def test_a_log_cut_short_resumes_as_the_stream_went(local_url: str, redis_url: str,
                                                     case: tuple[str, dict]) -> None:
    path, body = case
    r = httpx.post(local_url + path, json={**body, "stream": True}, timeout=60)
    assert r.status_code == 200
    request_id, full = r.headers["x-request-id"], parse_sse(r.text)
    assert [i for i, _ in full] == list(range(len(full))) and full[-1][1] == "[DONE]"
    cuts = [lambda m: 0, lambda m: 1, lambda m: m // 2, lambda m: m - 2]  # of m logged events
    for n, cut in enumerate(cuts, 1):
        logged = logged_events(redis_url, request_id)  # the last resume's (events fall anew)
        keep = cut(len(logged))
        sent = logged[:keep]  # what the stream's client got
        cut_log(redis_url, request_id, keep)
        headers = {"Last-Event-ID": str(keep - 1)} if keep else {}
        resumed = httpx.get(f"{local_url}/v1/streams/{request_id}", headers=headers, timeout=60)
        assert resumed.status_code == 200
        got = parse_sse(resumed.text)
        # what each choice says: the choices' chunks interleave as they come, and a choice's
        # outputs that waited together left as one chunk, in either stream. Each resume logs
        # its own events, so the kept events are those of the log, not of the first stream.
        assert [i for i, _ in got] == list(range(keep, keep + len(got)))
        assert got[-1][1] == "[DONE]"
        assert same(choices_content(sent + got), choices_content(full))
        state = redis_run(redis_url, lambda c, k: c.hgetall(k.request(request_id)))
        assert (state["status"], state["resumes"]) == ("finished", str(n))
    # the client got more than the dead gateway logged (events of one output each: a joined
    # one is logged before it is sent): those events are generated again, not sent. (With
    # several choices, how their events interleave is not generated again.)
    if len(choices_content(full)[0]) > 1:
        return
    entries = log_entries(redis_url, request_id)
    logged = logged_events(redis_url, request_id, entries)
    cut = unjoined_run(entries, 3)
    cut_log(redis_url, request_id, cut)
    last = cut + 2
    resumed = httpx.get(f"{local_url}/v1/streams/{request_id}?last_event_id={last}", timeout=60)
    got = parse_sse(resumed.text)
    assert got[0][0] == last + 1 and got[-1][1] == "[DONE]"
    assert same(choices_content(logged[:last + 1] + got), choices_content(full))


def test_a_live_stream_is_tailed(local_url: str) -> None:
    """Resumed while its gateway still generates it: the rest of the same events, no second
    generation."""
    body = {"prompt": PROMPT, "max_tokens": 300, "temperature": 0, "ignore_eos": True,
            "stream": True}
    before = metric(local_url + "/metrics", "pdserve:stream_resumes_total")

    async def go() -> tuple[Events, Events]:
        tail: asyncio.Task | None = None
        original: Events = []
        async with httpx.AsyncClient(timeout=60) as http, \
                http.stream("POST", local_url + "/v1/completions", json=body) as r:
            request_id = r.headers["x-request-id"]
            async for event in sse_lines(r.aiter_lines()):
                original.append(event)
                if len(original) == 3:
                    tail = asyncio.create_task(stream_events(
                        local_url, f"/v1/streams/{request_id}", headers={"Last-Event-ID": "1"}))
        assert tail is not None
        return original, (await tail)[1]

    original, tailed = asyncio.run(go())
    assert original[-1][1] == "[DONE]" and tailed == original[2:]
    assert metric(local_url + "/metrics", "pdserve:stream_resumes_total") == before


def test_resume_errors(local_url: str, bundled_tokenizer: Any) -> None:
    missing = httpx.get(f"{local_url}/v1/streams/cmpl-nothing", headers={"Last-Event-ID": "3"})
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "stream_not_found"
    bad = httpx.get(f"{local_url}/v1/streams/cmpl-nothing", headers={"Last-Event-ID": "x1"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "Last-Event-ID"
    no_redis = TestClient(build_app(FakeBackend(bundled_tokenizer)))
    unsupported = no_redis.get("/v1/streams/cmpl-anything")
    assert unsupported.status_code == 404
    assert unsupported.json()["error"]["code"] == "resume_not_supported"
    streamed = no_redis.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2,
                                                      "stream": True})
    events = parse_sse(streamed.text)  # ids without a log too (the fake backend's two
    assert [i for i, _ in events] == list(range(len(events)))  # tokens may share a chunk)
    assert len(events) >= 2 and events[-1][1] == "[DONE]"


# ---- a live cluster, two gateways on one Redis ---------------------------------------------
GREEDY = {"prompt": PROMPT, "max_tokens": 48, "temperature": 0, "ignore_eos": True,
          "stream": True, "stream_options": {"include_usage": True}}
CHAT_N2 = {"messages": CHAT, "n": 2, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
           "stream": True, "stream_options": {"include_usage": True}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_llama_dir: str) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("resume")
    with run_cluster(tmp, "--model", tiny_llama_dir, "--dtype", "float32", "--kv-cache-memory",
                     str(4 << 20), "--log-level", "warning") as c:
        yield c


async def sse_lines(lines: Any) -> Any:
    """(id, data) of each SSE event in a response's lines."""
    event_id = -1
    async for line in lines:
        if line.startswith("id: "):
            event_id = int(line[4:])
        elif line.startswith("data: "):
            yield event_id, line[6:]


async def stream_events(url: str, path: str, body: dict | None = None,
                        headers: dict | None = None, stop_after: int = 0,
                        on_stop: Any = None) -> tuple[str, Events]:
    """A stream's request id and events: all, or the first `stop_after` (then `on_stop()` runs
    while the connection is still open, and the client hangs up)."""
    async with httpx.AsyncClient(timeout=60) as http:
        method = "GET" if body is None else "POST"
        async with http.stream(method, url + path, json=body, headers=headers) as r:
            assert r.status_code == 200, await r.aread()
            events: Events = []
            async for event in sse_lines(r.aiter_lines()):
                events.append(event)
                if len(events) == stop_after:
                    on_stop()
                    break
            return r.headers["x-request-id"], events


def completion_content(events: Events) -> tuple[str, list[str | None], Any]:
    """Text and finish reasons of choice 0, and the usage (but its cache hits), of a
    completions stream."""
    chunks = [json.loads(d) for _, d in events if d != "[DONE]"]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    return ("".join(c["text"] for c in choices),
            [c["finish_reason"] for c in choices if c["finish_reason"]],
            _without_hits(chunks[-1]["usage"]))


def chat_content(events: Events) -> tuple[dict[int, str], dict[int, str], Any]:
    chunks = [json.loads(d) for _, d in events if d != "[DONE]"]
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for c in chunks:
        for choice in c["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + (
                choice["delta"].get("content") or "")
            if choice["finish_reason"]:
                reasons[choice["index"]] = choice["finish_reason"]
    return texts, reasons, _without_hits(chunks[-1]["usage"])


def assert_resumed(seen: Events, resumed: Events) -> None:
    """No gap, no repeat: the resumed ids go on from the last one seen, to [DONE]."""
    ids = [i for i, _ in seen + resumed]
    assert ids == list(range(len(ids))), ids
    assert resumed[-1][1] == "[DONE]"


def request_state(cluster: Cluster, request_id: str) -> dict[str, str]:
    async def go() -> dict[str, str]:
        client = connect(cluster.redis_url)
        try:
            return await RequestStore(client).get(request_id) or {}
        finally:
            await client.aclose()

    return asyncio.run(go())


@pytest.fixture(scope="module")
def expected(cluster: Cluster) -> tuple[str, Events]:
    """An uninterrupted greedy stream through the cluster's gateway."""
    return asyncio.run(stream_events(cluster.url, "/v1/completions", GREEDY))


def test_gateway_killed_mid_stream_resumes_through_another(cluster, expected) -> None:
    decode_pid = cluster.pids()["decode-0"]
    before = metric(cluster.url + "/metrics", "pdserve:stream_resumes_total")
    with extra_gateway(cluster) as (url_a, proc_a):
        def kill_gateway_a() -> None:
            os.kill(decode_pid, signal.SIGSTOP)  # the generation cannot finish meanwhile
            proc_a.kill()
            proc_a.wait()

        try:
            request_id, seen = asyncio.run(stream_events(
                url_a, "/v1/completions", GREEDY, stop_after=10, on_stop=kill_gateway_a))
        finally:
            os.kill(decode_pid, signal.SIGCONT)
    _, resumed = asyncio.run(stream_events(cluster.url, f"/v1/streams/{request_id}",
                                           headers={"Last-Event-ID": str(seen[-1][0])}))
    assert_resumed(seen, resumed)
    text, reasons, usage = completion_content(seen + resumed)
    assert (text, reasons, usage) == completion_content(expected[1])
    assert reasons == ["length"] and usage["completion_tokens"] == 48
    state = request_state(cluster, request_id)
    assert (state["status"], state["resumes"], state["output_tokens"]) == ("finished", "1", "48")
    assert metric(cluster.url + "/metrics", "pdserve:stream_resumes_total") == before + 1
    assert not any(any(x) for x in wait_idle(cluster, 20).values())


def test_client_gone_then_back_through_the_same_gateway(cluster) -> None:
    _, full = asyncio.run(stream_events(cluster.url, "/v1/chat/completions", CHAT_N2))
    decode_pid = cluster.pids()["decode-0"]
    try:
        request_id, seen = asyncio.run(stream_events(
            cluster.url, "/v1/chat/completions", CHAT_N2, stop_after=8,
            on_stop=lambda: os.kill(decode_pid, signal.SIGSTOP)))
        deadline = time.monotonic() + 10
        while request_state(cluster, request_id).get("status") != "cancelled":
            assert time.monotonic() < deadline, request_state(cluster, request_id)
            time.sleep(0.1)
    finally:
        os.kill(decode_pid, signal.SIGCONT)
    _, resumed = asyncio.run(stream_events(cluster.url, f"/v1/streams/{request_id}",
                                           headers={"Last-Event-ID": str(seen[-1][0])}))
    assert_resumed(seen, resumed)
    texts, reasons, usage = chat_content(seen + resumed)
    assert (texts, reasons, usage) == chat_content(full)
    assert reasons == {0: "length", 1: "length"} and usage["completion_tokens"] == 80
    state = request_state(cluster, request_id)
    assert (state["status"], state["resumes"]) == ("finished", "1")
    assert not any(any(x) for x in wait_idle(cluster, 20).values())


def test_a_finished_stream_replays_the_rest(cluster, expected) -> None:
    request_id, full = expected
    path = f"/v1/streams/{request_id}"
    _, rest = asyncio.run(stream_events(cluster.url, path, headers={"Last-Event-ID": "5"}))
    assert rest == full[6:]
    assert asyncio.run(stream_events(cluster.url, path + "?last_event_id=5"))[1] == full[6:]
    assert asyncio.run(stream_events(cluster.url, path))[1] == full
    status, body = http_get(cluster.url + "/v1/streams/cmpl-bogus")
    assert status == 404 and json.loads(body)["error"]["code"] == "stream_not_found"


def test_a_gateway_with_resume_ttl_zero_records_no_stream() -> None:
    """--resume-ttl-seconds 0: no EventLog (no Redis write per step); negative: refused; the
    writes' interval reaches the log's writer, and one that would starve the leases is
    refused."""
    import argparse

    from gateway.server import add_arguments, stream_log
    from pdserve.cluster.event_log import EventLog
    from pdserve.cluster.state import connect

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    client = connect("redis://127.0.0.1:1/0")  # lazy: no I/O here
    log = stream_log(client, parser.parse_args([]))
    assert isinstance(log, EventLog) and log.ttl_s == 300 and log.writer.interval_s == 0.01
    log = stream_log(client, parser.parse_args(["--resume-write-interval-ms", "0"]))
    assert log.writer.interval_s == 0
    for bad in ("-1", "1000"):  # 1 s: a third of the 3 s lease
        with pytest.raises(ValueError, match="interval"):
            stream_log(client, parser.parse_args(["--resume-write-interval-ms", bad]))
    assert stream_log(client, parser.parse_args(["--resume-ttl-seconds", "0"])) is None
    with pytest.raises(ValueError, match="--resume-ttl-seconds"):
        stream_log(client, parser.parse_args(["--resume-ttl-seconds", "-1"]))
