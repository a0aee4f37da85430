"""KV transfer faults between real worker processes over loopback gRPC (no gateway, no Redis).

One `pdserve prefill` and one `pdserve decode` (tiny random Llama, 64 blocks of 16 tokens,
--kv-timeout 3) serve the module, once per KV transport: `grpc` (the bytes in PushKV) and
`nixl` (NIXL agents WRITE them into the reserved blocks over host memory; PushKV carries the
header, KVWritten ranges and the commit), and once more over each with the decode engine in a
process of its own. A fake decode worker (tests/worker_procs.py) breaks
off pushes. Every test ends with both workers' blocks all free: a leak fails the next test too.

Hand-built pushes speak the transport too: over nixl they ask KVTarget for the blocks and send
KVWritten chunks (writing nothing: the checks under test are the receiver's). A request a data
plane may write into keeps its blocks until its push streams ended plus --kv-write-grace-seconds
(0.5 here), so over nixl a failed request frees its blocks a moment after the error.

The model is `tiny_llama_dir`'s with initializer_range 0.2 instead of 0.02: at 0.02 its greedy
output repeats the last prompt token whatever the KV holds (an all-zero push decodes the same
tokens), so token equality would prove nothing about the transfer.

    KV cell (1 layer x 1 block, K and V) = 2 x 16 tokens x 2 heads x 16 dims x 4 B = 4096 B
    --kv-slab-bytes 2048 < one cell, so every slab is one cell: a 3-block prompt is 6 slabs.
"""

from __future__ import annotations

import math
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace

import grpc
import pytest
from cluster import free_port
from worker_procs import spawn_fake_decode, spawn_worker, stop_all, wait_serving

from decode_svc.convert import layout_to_pb
from engine.kv_transfer import KVLayout, layout_of, plan_slabs
from pdserve.cluster.convert import sampling_params_to_pb
from pdserve.cluster.grpc_server import GRPC_OPTIONS
from protos import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

NUM_BLOCKS = 64
BLOCK_SIZE = 16
SLAB_BYTES = 2048
KV_TIMEOUT_S = 3
WRITE_GRACE_S = 0.5
MAX_TOKENS = 8
TEXTS = [
    "The tiny model says",
    "A longer prompt that needs more than one block of sixteen tokens to hold its keys and "
    "values, so the transfer moves several blocks of them, layer by layer, from the prefill "
    "worker to the decode worker",
]


@dataclass(frozen=True)
class Reference:
    """One prompt and the colocated engine's greedy continuation of it."""

    prompt: list[int]
    tokens: list[int]
    finish_reason: str

    @property
    def num_blocks(self) -> int:
        return math.ceil(len(self.prompt) / BLOCK_SIZE)


@dataclass(frozen=True)
class Workers:
    prefill: prefill_pb2_grpc.PrefillStub
    decode: decode_pb2_grpc.DecodeStub
    decode_address: str
    layout: KVLayout
    short: Reference  # one block
    long: Reference  # three blocks
    transport: str  # "grpc" | "nixl"
    decode_metrics: str  # the decode worker's /metrics URL
    pool_id: str = field(default="")  # the decode worker's KV pool (nixl)
    prefill_metrics: str = ""  # the prefill worker's /metrics URL
    # the blocks each Generate granted to a data-plane push ahead (nixl), by request id
    grants: dict[str, common_pb2.KVTargetGrant] = field(default_factory=dict)


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """`tiny_llama_dir`'s config and tokenizer, weights drawn with std 0.2 (see the top)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = tmp_path_factory.mktemp("kv_sensitive_llama")
    config = AutoConfig.from_pretrained(tiny_llama_dir)
    config.initializer_range = 0.2
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.float32).save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_llama_dir).save_pretrained(path)
    return str(path)


def _nixl_installed() -> bool:
    from pdserve.transport.base import nixl_available

    return nixl_available()


@pytest.fixture(scope="module", params=[
    "grpc",
    pytest.param("nixl", marks=pytest.mark.skipif(not _nixl_installed(),
                                                  reason="NIXL not installed (pdserve[nixl])")),
    "grpc, decode engine core process",
    pytest.param("nixl, decode engine core process",
                 marks=pytest.mark.skipif(not _nixl_installed(),
                                          reason="NIXL not installed (pdserve[nixl])")),
    pytest.param("nixl, prefill engine core process",
                 marks=pytest.mark.skipif(not _nixl_installed(),
                                          reason="NIXL not installed (pdserve[nixl])")),
])
def workers(request: pytest.FixtureRequest, model_dir: str) -> Iterator[Workers]:
    """Both workers, started together; the reference runs in this process while they load.
    The "decode engine core process" rounds: the decode engine's step loop in a process of its
    own (`--engine-core process`, decode_svc/engine_core.py): the grpc push writes into its pool
    mapped in the worker's process, NIXL's agent and the pool's export live in the engine core
    process. The "prefill engine core process" round: the prefill engine's (prefill_svc/
    engine_core.py): the pushes read its pool mapped in the worker's process, from the first
    token on (its grpc push: tests/test_bench_prefill_burst.py)."""
    transport, _, core = request.param.partition(", ")
    where = core.split(" ")[0]  # whose engine core runs in a process of its own
    pport, dport, mport, pmport = free_port(), free_port(), free_port(), free_port()
    common = ["--num-kv-blocks", str(NUM_BLOCKS), "--dtype", "float32",
              "--kv-transport", transport]
    prefill = spawn_worker("prefill", model_dir, pport, *common,
                           "--kv-slab-bytes", str(SLAB_BYTES), "--metrics-port", str(pmport),
                           *(["--engine-core", "process"] if where == "prefill" else []))
    # no prefix caching on the decode worker: the cases resend the same prompts, and each push
    # must carry all of it (decode-side reuse: test_kv_receiver, test_cluster_kv_routing)
    decode = spawn_worker("decode", model_dir, dport, *common, "--no-prefix-caching",
                          "--kv-timeout", str(KV_TIMEOUT_S), "--metrics-port", str(mport),
                          "--kv-write-grace-seconds", str(WRITE_GRACE_S),
                          *(["--engine-core", "process"] if where == "decode" else []))
    try:
        layout, short, long = _reference(model_dir)
        paddr, daddr = f"127.0.0.1:{pport}", f"127.0.0.1:{dport}"
        wait_serving(prefill, paddr)
        wait_serving(decode, daddr)
        with grpc.insecure_channel(paddr, options=GRPC_OPTIONS) as pch, \
                grpc.insecure_channel(daddr, options=GRPC_OPTIONS) as dch:
            dstub = decode_pb2_grpc.DecodeStub(dch)
            pool = dstub.DescribeKV(decode_pb2.DescribeKVRequest(transports=[transport]))
            assert transport in pool.transports  # its NIXL agent started
            assert pool.push_streams  # it serves PushKVStreams
            yield Workers(prefill_pb2_grpc.PrefillStub(pch), dstub, daddr, layout, short, long,
                          transport, f"http://127.0.0.1:{mport}/metrics", pool.pool_id,
                          f"http://127.0.0.1:{pmport}/metrics")
    finally:
        stop_all([prefill, decode])


def _reference(model: str) -> tuple[KVLayout, Reference, Reference]:
    from pdserve import LLM, SamplingParams

    llm = LLM(model, dtype="float32", num_kv_blocks=NUM_BLOCKS)
    outs = llm.generate(TEXTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                        use_tqdm=False)
    short, long = (Reference(o.prompt_token_ids, o.outputs[0].token_ids,
                             o.outputs[0].finish_reason or "") for o in outs)
    assert (short.num_blocks, long.num_blocks) == (1, 3)
    return layout_of(llm.llm_engine.runner.kv_caches), short, long


# ---- helpers ---------------------------------------------------------------------------------
def _params(max_tokens: int = MAX_TOKENS, **kw: object) -> common_pb2.SamplingParams:
    from pdserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, **kw)
    return sampling_params_to_pb(params, max_tokens)


def _load(stub: prefill_pb2_grpc.PrefillStub | decode_pb2_grpc.DecodeStub) -> tuple[int, ...]:
    """(num_running, num_waiting, num_free_blocks, num_total_blocks)."""
    w = stub.GetLoad(common_pb2.GetLoadRequest(), timeout=5)
    return w.num_running, w.num_waiting, w.num_free_blocks, w.num_total_blocks


IDLE = (0, 0, NUM_BLOCKS, NUM_BLOCKS)


def _reserved(num_blocks: int) -> tuple[int, ...]:
    """A decode worker's load with one request waiting for `num_blocks` blocks of KV."""
    return 0, 1, NUM_BLOCKS - num_blocks, NUM_BLOCKS


def _wait_idle(stub: prefill_pb2_grpc.PrefillStub | decode_pb2_grpc.DecodeStub,
               timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (load := _load(stub)) != IDLE:
        assert time.monotonic() < deadline, f"not idle after {timeout_s} s: {load}"
        time.sleep(0.05)


def _open(w: Workers, request_id: str, ref: Reference,
          params: common_pb2.SamplingParams | None = None) -> grpc.Call:
    """Generate on the decode worker, up to its first message (no tokens): blocks reserved.
    Over a data plane that message grants the reserved blocks to push 1 (kept in `w.grants`)."""
    assert _load(w.decode) == IDLE
    call = w.decode.Generate(decode_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=ref.prompt, params=params or _params()),
        timeout=30)
    first = next(call)
    if w.transport == "grpc":
        assert first == decode_pb2.GenerateResponse()
    else:
        grant = first.kv_target
        assert first == decode_pb2.GenerateResponse(kv_target=grant)
        assert (grant.pool_id, grant.push_id) == (w.pool_id, 1)
        assert len(grant.block_ids) == ref.num_blocks
        w.grants[request_id] = grant
    assert _load(w.decode) == _reserved(ref.num_blocks)
    return call


def _rpc_error(fn: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value


def _header(request_id: str, layout: KVLayout, ref: Reference,
            w: Workers | None = None) -> decode_pb2.KVChunk:
    """The push's header; over a data plane (`w.transport` nixl) after asking KVTarget, whose
    push id it carries (a request unknown there gets push id 0)."""
    header = decode_pb2.KVHeader(
        request_id=request_id, layout=layout_to_pb(layout), num_tokens=len(ref.prompt),
        num_blocks=ref.num_blocks)
    if w is not None and w.transport != "grpc":
        header.transport = w.transport
        try:
            header.push_id = _target(w, request_id).push_id
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.NOT_FOUND
    return decode_pb2.KVChunk(header=header)


def _target(w: Workers, request_id: str, pool_id: str | None = None,
            transport: str | None = None) -> decode_pb2.KVTargetReply:
    return w.decode.KVTarget(decode_pb2.KVTargetRequest(
        request_id=request_id, pool_id=w.pool_id if pool_id is None else pool_id,
        transport=transport or w.transport), timeout=10)


def _commit(ref: Reference) -> decode_pb2.KVChunk:
    return decode_pb2.KVChunk(commit=decode_pb2.KVCommit(first_token_id=ref.tokens[0]))


def _slabs(layout: KVLayout, num_blocks: int,
           w: Workers | None = None) -> list[decode_pb2.KVChunk]:
    """Slabs covering every layer x block, planned like the prefill worker's: zero-filled
    KVData, or over a data plane KVWritten ranges (nothing written)."""
    written = w is not None and w.transport != "grpc"
    return [
        _written(l0, l1, b0, b1) if written
        else _data(l0, l1, b0, b1, (l1 - l0) * (b1 - b0) * layout.cell_bytes())
        for l0, l1, b0, b1 in plan_slabs(layout, num_blocks, SLAB_BYTES)
    ]


def _data(l0: int, l1: int, b0: int, b1: int, nbytes: int) -> decode_pb2.KVChunk:
    return decode_pb2.KVChunk(data=decode_pb2.KVData(
        layer_start=l0, layer_end=l1, block_start=b0, block_end=b1, data=bytes(nbytes)))


def _written(l0: int, l1: int, b0: int, b1: int) -> decode_pb2.KVChunk:
    return decode_pb2.KVChunk(written=decode_pb2.KVWritten(
        layer_start=l0, layer_end=l1, block_start=b0, block_end=b1))


def _push(w: Workers, chunks: Iterable[decode_pb2.KVChunk]) -> decode_pb2.PushKVResponse:
    return w.decode.PushKV(iter(list(chunks)), timeout=10)


def _freed(w: Workers) -> None:
    """The decode worker freed the failed request's blocks: at once over grpc; over a data plane
    only after its push streams ended plus the write grace (they are still held right after)."""
    if w.transport == "grpc":
        assert _load(w.decode) == IDLE
    else:
        _wait_idle(w.decode, timeout_s=WRITE_GRACE_S + 5)


# ---- 1. the push to the decode side breaks off: the prefill side frees its blocks ------------
@pytest.mark.parametrize("then", ["abort", "hang"])
def test_transfer_cut_off_midway_frees_the_prefill_blocks(workers: Workers, then: str) -> None:
    """The fake decode worker reads the header and one slab of six, then aborts with
    UNAVAILABLE (`abort`) or hangs until SIGKILLed (`hang`)."""
    w, ref, rid = workers, workers.long, f"cut-{then}"
    assert _load(w.prefill) == IDLE
    port = free_port()
    fake = spawn_fake_decode(port, chunks=1, then=then)
    try:
        reply = w.prefill.Prefill(prefill_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=ref.prompt, params=_params(),
            decode_address=f"127.0.0.1:{port}"), timeout=30)
        assert (reply.first_token_id, reply.finish_reason) == (ref.tokens[0], "")
        assert fake.next_event() == {
            "event": "header", "request_id": rid, "num_tokens": len(ref.prompt),
            "num_blocks": 3, "layout": [2, 2, 16, "float32", BLOCK_SIZE],
        }
        full = len(plan_slabs(w.layout, ref.num_blocks, SLAB_BYTES))
        assert full == 6
        assert fake.next_event() == {"event": "data", "range": [0, 1, 0, 1], "nbytes": 4096}
        assert fake.next_event() == {"event": "breaking", "then": then}
        if then == "hang":
            # Prefill answered while its push is stuck mid-stream; the blocks wait for it.
            assert _load(w.prefill) == (0, 0, NUM_BLOCKS - 3, NUM_BLOCKS)
            fake.popen.send_signal(signal.SIGKILL)
            assert fake.popen.wait(timeout=10) == -signal.SIGKILL
        _wait_idle(w.prefill)
    finally:
        stop_all([fake])


# ---- 2. KV that never arrives, or stalls past the timeout -----------------------------------
def test_kv_that_never_arrives_times_out_and_frees_the_blocks(workers: Workers) -> None:
    started = time.monotonic()
    call = _open(workers, "never", workers.long)
    err = _rpc_error(lambda: next(call))
    assert time.monotonic() - started >= KV_TIMEOUT_S
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert err.details() == "KV of request 'never' did not arrive: nothing came for 3 s"
    _freed(workers)  # over a data plane the granted blocks wait out the write grace


def test_a_push_that_outlives_its_generate_is_refused(workers: Workers) -> None:
    """Header and one slab, then a stall past --kv-timeout: the Generate fails and frees the
    blocks; the rest of the push must not be written into them (another request may own them
    by then) nor committed."""
    w, ref, rid = workers, workers.long, "stalled"
    call = _open(w, rid, ref)
    slabs = _slabs(w.layout, ref.num_blocks, w)
    resume = threading.Event()
    header = _header(rid, w.layout, ref, w)

    def chunks() -> Iterator[decode_pb2.KVChunk]:
        yield header
        yield slabs[0]
        assert resume.wait(timeout=20)
        yield from slabs[1:]
        yield _commit(ref)

    push = w.decode.PushKV.future(chunks(), timeout=30)
    err = _rpc_error(lambda: next(call))
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert err.details() == "KV of request 'stalled' did not arrive: nothing came for 3 s"
    if w.transport != "grpc":  # the open push may still write: the blocks wait for it
        time.sleep(2 * WRITE_GRACE_S)
        assert _load(w.decode) == _reserved(ref.num_blocks)
    else:
        assert _load(w.decode) == IDLE
    resume.set()
    err = _rpc_error(push.result)
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert err.details() == "request 'stalled' was dropped while its KV arrived: request aborted"
    _freed(w)


def test_a_push_slower_than_the_timeout_but_never_idle_that_long_completes(
    workers: Workers,
) -> None:
    """--kv-timeout bounds the time without progress, not the push: the push streams while the
    prompt is computed, which can take longer than the timeout."""
    w, ref, rid = workers, workers.long, "slow"
    call = _open(w, rid, ref)
    slabs = _slabs(w.layout, ref.num_blocks, w)
    gap = KV_TIMEOUT_S * 0.6  # two pauses: the push takes longer than the timeout
    pause_before = {0, len(slabs) // 2}
    assert len(slabs) >= 2 and gap * len(pause_before) > KV_TIMEOUT_S
    header = _header(rid, w.layout, ref, w)

    def chunks() -> Iterator[decode_pb2.KVChunk]:
        yield header
        for i, slab in enumerate(slabs):
            if i in pause_before:
                time.sleep(gap)
            yield slab
        time.sleep(gap)
        yield _commit(ref)

    reply = w.decode.PushKV(chunks(), timeout=30)
    assert reply.bytes_received == ref.num_blocks * w.layout.num_layers * w.layout.cell_bytes()
    assert len([t for msg in call for t in msg.token_ids]) == len(ref.tokens) - 1
    _wait_idle(w.decode)


# ---- 3. bad pushes to a real decode worker ---------------------------------------------------
Chunks = list[decode_pb2.KVChunk]


def _wrong_layout(rid: str, lay: KVLayout, ref: Reference, w: Workers) -> Chunks:
    bad = replace(lay, num_kv_heads=3, block_size=32)
    return [_header(rid, bad, ref, w), *_slabs(lay, ref.num_blocks, w)]


def _wrong_block_count(rid: str, lay: KVLayout, ref: Reference, w: Workers) -> Chunks:
    head = _header(rid, lay, ref, w)
    head.header.num_blocks = 2
    return [head, *_slabs(lay, 2, w)]


def _short_slab(rid: str, lay: KVLayout, ref: Reference, w: Workers) -> Chunks:
    slabs = _slabs(lay, ref.num_blocks)
    slabs[2].data.data = slabs[2].data.data[:-1]
    return [_header(rid, lay, ref), *slabs, _commit(ref)]


def _truncated(rid: str, lay: KVLayout, ref: Reference, w: Workers) -> Chunks:
    return [_header(rid, lay, ref, w), *_slabs(lay, ref.num_blocks, w)[:-1]]


def _early_commit(rid: str, lay: KVLayout, ref: Reference, w: Workers) -> Chunks:
    return [_header(rid, lay, ref, w), *_slabs(lay, ref.num_blocks, w)[:-1], _commit(ref)]


def _no_commit(rid: str, lay: KVLayout, ref: Reference, w: Workers) -> Chunks:
    return [_header(rid, lay, ref, w), *_slabs(lay, ref.num_blocks, w)]


def _overlap(rid: str, lay: KVLayout, ref: Reference, w: Workers) -> Chunks:
    slabs = _slabs(lay, ref.num_blocks, w)
    return [_header(rid, lay, ref, w), slabs[0], *slabs, _commit(ref)]


def _out_of_range(rid: str, lay: KVLayout, ref: Reference, w: Workers) -> Chunks:
    slab = _data(0, 1, 3, 4, lay.cell_bytes()) if w.transport == "grpc" else _written(0, 1, 3, 4)
    return [_header(rid, lay, ref, w), slab]


def _two_headers(rid: str, lay: KVLayout, ref: Reference, w: Workers) -> Chunks:
    return [_header(rid, lay, ref, w), _header(rid, lay, ref)]


def _bytes_over_a_data_plane(rid: str, lay: KVLayout, ref: Reference, w: Workers) -> Chunks:
    return [_header(rid, lay, ref, w), *_slabs(lay, ref.num_blocks), _commit(ref)]


BAD_PUSHES = {
    "wrong layout": (
        _wrong_layout,
        "KV layout mismatch: num_kv_heads: sender 3 != receiver 2; "
        "block_size: sender 32 != receiver 16",
    ),
    "wrong block count": (_wrong_block_count, "header announces 2 blocks, 3 reserved"),
    "slab one byte short": (_short_slab, "KV slab holds 4095 bytes, expected 4096"),
    "commit before the last slab": (
        _early_commit, "KV commit before every layer and block arrived"),
    "slab sent twice": (_overlap, "KV slab layers [0, 1) x blocks [0, 1) overlaps another"),
    "block out of range": (
        _out_of_range, "KV slab range layers [0, 1) x blocks [3, 4) is invalid"),
    "second header": (
        _two_headers, "a KV stream carries one header, then {chunks} chunks and a commit"),
    "KVData on a data plane": (
        _bytes_over_a_data_plane,
        "a KV stream carries one header, then {chunks} chunks and a commit"),
}
GRPC_ONLY = {"slab one byte short"}  # a data-plane push carries no bytes to count
DATA_PLANE_ONLY = {"KVData on a data plane"}


@pytest.mark.parametrize("case", list(BAD_PUSHES))
def test_a_bad_push_fails_it_and_its_generate_and_frees_the_blocks(
    workers: Workers, case: str
) -> None:
    """INVALID_ARGUMENT naming the fault to the sender; UNAVAILABLE with the same reason to the
    waiting Generate. (decode.proto says FAILED_PRECONDITION for a layout mismatch; the shared
    interceptor maps the receiver's ValueError to INVALID_ARGUMENT.)"""
    build, message = BAD_PUSHES[case]
    w, ref, rid = workers, workers.long, f"bad-{case.replace(' ', '-')}"
    if case in (GRPC_ONLY if w.transport != "grpc" else DATA_PLANE_ONLY):
        pytest.skip(f"not a {w.transport} push")
    message = message.format(chunks="data" if w.transport == "grpc" else "nixl written")
    call = _open(w, rid, ref)
    err = _rpc_error(lambda: _push(w, build(rid, w.layout, ref, w)))
    assert (err.code(), err.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)
    _freed(w)
    err = _rpc_error(lambda: next(call))
    assert (err.code(), err.details()) == (grpc.StatusCode.UNAVAILABLE,
                                           f"KV transfer failed: {message}")
    assert _load(w.decode) == IDLE


CUT_PUSHES = {
    "stream ends early": (_truncated, "KV stream ended before every layer and block arrived"),
    "no commit": (_no_commit, "KV stream ended without its commit"),
}


@pytest.mark.parametrize("case", list(CUT_PUSHES))
def test_a_push_cut_short_leaves_the_reservation_to_the_next_push(
    workers: Workers, case: str
) -> None:
    """A push that ends before its commit is its sender stopping (a prefill worker lost, or the
    request ended at its first token), not bad bytes: UNAVAILABLE to the sender, the blocks stay
    reserved, and the prefill the gateway retries pushes into them; its KV decodes the
    colocated tokens."""
    build, message = CUT_PUSHES[case]
    w, ref, rid = workers, workers.long, f"cut-{case.replace(' ', '-')}"
    call = _open(w, rid, ref)
    err = _rpc_error(lambda: _push(w, build(rid, w.layout, ref, w)))
    assert (err.code(), err.details()) == (grpc.StatusCode.UNAVAILABLE, message)
    assert _load(w.decode) == _reserved(ref.num_blocks)
    reply = w.prefill.Prefill(prefill_pb2.PrefillRequest(
        request_id=rid, prompt_token_ids=ref.prompt, params=_params(),
        decode_address=w.decode_address), timeout=30)
    assert [reply.first_token_id, *(t for msg in call for t in msg.token_ids)] == ref.tokens
    _wait_idle(w.prefill)
    _wait_idle(w.decode)


@pytest.mark.parametrize(("chunks", "message"), [
    ([], "empty KV stream"),
    ([_data(0, 1, 0, 1, 4096)], "a KV stream must start with a KVHeader"),
])
def test_a_push_without_a_header_is_refused_and_reserves_nothing(
    workers: Workers, chunks: list[decode_pb2.KVChunk], message: str
) -> None:
    err = _rpc_error(lambda: _push(workers, chunks))
    assert (err.code(), err.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)
    assert _load(workers.decode) == IDLE


def test_a_push_for_an_unknown_request_is_not_found_and_leaves_others_waiting(
    workers: Workers,
) -> None:
    w, ref = workers, workers.long
    call = _open(w, "known", ref)
    chunks = [_header("ghost", w.layout, ref, w), *_slabs(w.layout, ref.num_blocks, w)]
    err = _rpc_error(lambda: _push(w, chunks))
    assert (err.code(), err.details()) == (
        grpc.StatusCode.NOT_FOUND, "no open Generate waiting for KV of request 'ghost'")
    assert _load(w.decode) == _reserved(ref.num_blocks)
    call.cancel()
    _wait_idle(w.decode)


# ---- 4. the client gives up while waiting for the KV -----------------------------------------
def test_cancelling_generate_frees_the_blocks_and_refuses_a_later_push(workers: Workers) -> None:
    w, ref, rid = workers, workers.long, "cancelled"
    call = _open(w, rid, ref)
    assert call.cancel()
    _wait_idle(w.decode)
    chunks = [_header(rid, w.layout, ref, w), *_slabs(w.layout, ref.num_blocks, w)]
    err = _rpc_error(lambda: _push(w, chunks))
    assert (err.code(), err.details()) == (
        grpc.StatusCode.NOT_FOUND, "no open Generate waiting for KV of request 'cancelled'")
    assert _load(w.decode) == IDLE


# ---- 5. the happy path through both processes ------------------------------------------------
@pytest.mark.parametrize("which", ["short", "long"])
def test_disaggregated_tokens_equal_colocated(workers: Workers, which: str) -> None:
    """Generate on decode, Prefill naming it: its first token, then the decode stream's deltas,
    equal `LLM.generate` greedy; both workers end with every block free."""
    w, ref, rid = workers, getattr(workers, which), f"happy-{which}"
    assert _load(w.prefill) == IDLE
    carried = _transport_bytes(w)
    call = _open(w, rid, ref)
    reply = w.prefill.Prefill(prefill_pb2.PrefillRequest(
        request_id=rid, prompt_token_ids=ref.prompt, params=_params(),
        decode_address=w.decode_address), timeout=30)
    assert reply.finish_reason == ""
    tokens, finish = [reply.first_token_id], []
    for msg in call:
        tokens += msg.token_ids
        finish.append(msg.finish_reason)
    assert tokens == ref.tokens
    assert finish[-1] == ref.finish_reason and set(finish[:-1]) <= {""}
    _wait_idle(w.prefill)
    _wait_idle(w.decode)
    kv_bytes = ref.num_blocks * w.layout.num_layers * w.layout.cell_bytes()
    assert _transport_bytes(w) - carried == kv_bytes  # over the module's transport, no other


@pytest.mark.parametrize("order", ["prefill first", "reserved first"])
def test_a_prefill_sent_beside_the_reservation_pushes_once_told(
    workers: Workers, order: str
) -> None:
    """The gateway's order for a new request (gateway/remote_backend.py): the Prefill goes out
    while the decode worker reserves (decode_reservation_pending), its first token comes back
    at once, and its push waits for Reserved (what the reservation said), which may reach the
    prefill worker before the Prefill does. Tokens equal colocated, every block free after."""
    w, ref, rid = workers, workers.long, f"beside-{order.split()[0]}"
    request = prefill_pb2.PrefillRequest(
        request_id=rid, prompt_token_ids=ref.prompt, params=_params(),
        decode_address=w.decode_address, decode_reservation_pending=True)

    def tell() -> prefill_pb2.ReservedResponse:
        return w.prefill.Reserved(prefill_pb2.ReservedRequest(
            request_id=rid, decode_kv_target=w.grants.get(rid)), timeout=10)

    if order == "prefill first":
        reply = w.prefill.Prefill(request, timeout=30)  # nothing reserved anywhere yet
        assert _load(w.prefill) == (0, 0, NUM_BLOCKS - ref.num_blocks, NUM_BLOCKS)  # held
        call = _open(w, rid, ref)
        assert tell().found
    else:
        call = _open(w, rid, ref)
        assert not tell().found  # kept for the Prefill to come
        reply = w.prefill.Prefill(request, timeout=30)
    assert [reply.first_token_id, *(t for msg in call for t in msg.token_ids)] == ref.tokens
    _wait_idle(w.prefill)
    _wait_idle(w.decode)


def _transport_bytes(w: Workers) -> float:
    """KV bytes the decode worker received over `w.transport` (its labelled counter)."""
    return _counter(w.decode_metrics, "pdserve:kv_transfer_bytes_total", transport=w.transport)


def _counter(url: str, name: str, **labels: str) -> float:
    from cluster import http_get
    from prometheus_client.parser import text_string_to_metric_families

    _, text = http_get(url)
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples if s.name == name
               and all(s.labels.get(k) == v for k, v in labels.items()))


@pytest.mark.parametrize("how", ["max_tokens 1", "stop token"])
def test_a_request_that_ends_at_its_first_token_leaves_no_blocks(
    workers: Workers, how: str
) -> None:
    """max_tokens 1: the prefill worker knows it at once and pushes nothing. A stop token (or
    eos): the push already under way is cut off; the decode worker keeps the reservation until
    the gateway cancels the Generate it no longer needs. Either way both workers end with every
    block free once it does."""
    w, ref, rid = workers, workers.long, f"ends-{how.replace(' ', '-')}"
    params = _params(1) if how == "max_tokens 1" else _params(stop_token_ids=[ref.tokens[0]])
    call = _open(w, rid, ref, params)
    reply = w.prefill.Prefill(prefill_pb2.PrefillRequest(
        request_id=rid, prompt_token_ids=ref.prompt, params=params,
        decode_address=w.decode_address), timeout=30)
    assert (reply.first_token_id, reply.finish_reason) == (
        ref.tokens[0], "length" if how == "max_tokens 1" else "stop")
    _wait_idle(w.prefill)
    assert _load(w.decode) == _reserved(ref.num_blocks)  # cut off or nothing came: waiting
    call.cancel()
    _wait_idle(w.decode)


def test_a_zero_filled_push_decodes_other_tokens(workers: Workers) -> None:
    """The control that gives the equality above its meaning: the same first token over an
    all-zero KV continues differently, so the decode worker's tokens depend on the pushed KV."""
    w, ref, rid = workers, workers.long, "zeros"
    if w.transport != "grpc":
        pytest.skip("a data-plane push of nothing leaves the blocks' old bytes")
    call = _open(w, rid, ref)
    reply = _push(w, [_header(rid, w.layout, ref), *_slabs(w.layout, ref.num_blocks),
                      _commit(ref)])
    assert reply.bytes_received == 6 * w.layout.cell_bytes()
    tokens = [ref.tokens[0], *(t for msg in call for t in msg.token_ids)]
    assert len(tokens) == len(ref.tokens) and tokens != ref.tokens
    _wait_idle(w.decode)


# ---- 6. data-plane targets: stale pools, transports not offered, a newer push ----------------
def _data_plane_only(w: Workers) -> None:
    if w.transport == "grpc":
        pytest.skip("a data-plane (KVTarget) case")


def test_a_stale_pool_is_refused_before_anything_is_written(workers: Workers) -> None:
    """A sender holding the handle of an earlier decode process (another pool id) learns it
    from KVTarget, before it writes a byte; the reservation is untouched."""
    w, ref, rid = workers, workers.long, "stale-pool"
    _data_plane_only(w)
    call = _open(w, rid, ref)
    err = _rpc_error(lambda: _target(w, rid, pool_id="0" * 32))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.details() == (f"KV pool '{'0' * 32}' is stale: this worker's pool is "
                             f"'{w.pool_id}' (it restarted)")
    err = _rpc_error(lambda: _target(w, rid, transport="cuda_ipc"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("KV transport 'cuda_ipc' is not offered here")
    assert _load(w.decode) == _reserved(ref.num_blocks)
    call.cancel()
    _freed(w)  # Generate granted the blocks to a data-plane push: freed after the grace


def test_a_newer_target_cuts_the_older_data_plane_push(workers: Workers) -> None:
    """A second KVTarget (the gateway retried the prefill elsewhere) takes the blocks over
    (after waiting for an open older writer up to the write grace): the older stream is cut at
    its next chunk and the newer one commits; the blocks end free."""
    w, ref, rid = workers, workers.long, "newer-target"
    _data_plane_only(w)
    call = _open(w, rid, ref)
    slabs = _slabs(w.layout, ref.num_blocks, w)
    first = _header(rid, w.layout, ref, w)
    resume = threading.Event()

    def older() -> Iterator[decode_pb2.KVChunk]:
        yield first
        yield slabs[0]
        assert resume.wait(timeout=20)
        yield from slabs[1:]

    old_push = w.decode.PushKV.future(older(), timeout=30)
    time.sleep(0.5)  # most likely open there by now (whether the target waits is not asserted:
    # nothing outside the worker says when the older stream's header was read)
    second = _header(rid, w.layout, ref, w)  # KVTarget again
    assert second.header.push_id == first.header.push_id + 1
    resume.set()
    err = _rpc_error(old_push.result)
    assert (err.code(), err.details()) == (grpc.StatusCode.UNAVAILABLE,
                                           "a newer push of the request took over its blocks")
    reply = _push(w, [second, *slabs, _commit(ref)])
    assert reply.bytes_received == ref.num_blocks * w.layout.num_layers * w.layout.cell_bytes()
    assert len([t for msg in call for t in msg.token_ids]) == len(ref.tokens) - 1
    _wait_idle(w.decode)


# ---- 7. the grant on Generate's first message; the last range inside the commit --------------
def test_a_push_into_the_granted_blocks_needs_no_target_and_commits_its_last_range(
    workers: Workers,
) -> None:
    """Over a data plane, Generate's first message grants the reserved blocks to push 1: a push
    naming that id writes without KVTarget, and its commit may carry the last KVWritten range
    (a commit completing the KV that way is accepted; without it the KV is incomplete)."""
    w, ref, rid = workers, workers.long, "granted"
    _data_plane_only(w)
    call = _open(w, rid, ref)
    header = _header(rid, w.layout, ref)
    header.header.transport, header.header.push_id = w.transport, w.grants[rid].push_id
    *slabs, last = _slabs(w.layout, ref.num_blocks, w)
    commit = _commit(ref)
    commit.commit.written.CopyFrom(last.written)
    reply = _push(w, [header, *slabs, commit])
    assert reply.bytes_received == ref.num_blocks * w.layout.num_layers * w.layout.cell_bytes()
    assert len([t for msg in call for t in msg.token_ids]) == len(ref.tokens) - 1
    _wait_idle(w.decode)


def test_a_grpc_commit_carrying_a_written_range_fails_the_request(workers: Workers) -> None:
    """Only a data plane announces ranges: a grpc push whose commit carries one is refused and
    its request failed, its blocks freed."""
    w, ref, rid = workers, workers.short, "grpc-commit-written"
    if w.transport != "grpc":
        pytest.skip("a grpc push")
    call = _open(w, rid, ref)
    commit = _commit(ref)
    commit.commit.written.CopyFrom(decode_pb2.KVWritten(layer_end=1, block_end=1))
    err = _rpc_error(lambda: _push(w, [_header(rid, w.layout, ref),
                                       *_slabs(w.layout, ref.num_blocks), commit]))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "a grpc push's commit carries no written range"
    assert _rpc_error(lambda: list(call)).code() != grpc.StatusCode.OK
    _freed(w)


def test_the_gateway_path_writes_into_the_grant(workers: Workers) -> None:
    """A Prefill naming the decode worker's grant (as the gateway passes it on) pushes over the
    data plane without KVTarget: the tokens equal colocated and the prefill worker counts a
    granted push, both workers a push over the shared PushKVStreams call."""
    w, ref, rid = workers, workers.long, "gateway-grant"
    _data_plane_only(w)
    granted = _counter(w.prefill_metrics, "pdserve:kv_transfer_granted_pushes_total")
    shared = [_counter(m, SHARED) for m in (w.prefill_metrics, w.decode_metrics)]
    call = _open(w, rid, ref)
    reply = w.prefill.Prefill(prefill_pb2.PrefillRequest(
        request_id=rid, prompt_token_ids=ref.prompt, params=_params(),
        decode_address=w.decode_address, decode_kv_target=w.grants[rid]), timeout=30)
    tokens = [reply.first_token_id, *(t for msg in call for t in msg.token_ids)]
    assert tokens == ref.tokens
    _wait_idle(w.prefill)
    _wait_idle(w.decode)
    assert _counter(w.prefill_metrics, "pdserve:kv_transfer_granted_pushes_total") == granted + 1
    assert [_counter(m, SHARED) for m in (w.prefill_metrics, w.decode_metrics)] == [
        n + 1 for n in shared]


# ---- 8. many requests' data-plane pushes on one PushKVStreams call ---------------------------
SHARED = "pdserve:kv_transfer_shared_stream_pushes_total"
OK = grpc.StatusCode.OK.value[0]


def _entry(rid: str, push_id: int, chunk: decode_pb2.KVChunk | None = None
           ) -> decode_pb2.KVStreamChunk:
    """One push's chunk on the shared call; without a chunk, its cut."""
    if chunk is None:
        return decode_pb2.KVStreamChunk(request_id=rid, push_id=push_id, cut=True)
    return decode_pb2.KVStreamChunk(request_id=rid, push_id=push_id, chunk=chunk)


def _streams(w: Workers, *messages: list[decode_pb2.KVStreamChunk]
             ) -> dict[str, decode_pb2.KVPushOutcome]:
    """One PushKVStreams call sending `messages` (each one KVStreamsRequest), then ending: the
    outcomes by request id."""
    requests = iter([decode_pb2.KVStreamsRequest(chunks=m) for m in messages])
    replies = w.decode.PushKVStreams(requests, timeout=20)
    return {o.request_id: o for reply in replies for o in reply.outcomes}


def _open_many(w: Workers, refs: dict[str, Reference]) -> dict[str, grpc.Call]:
    """Generate for each request id, up to its grant (its blocks reserved)."""
    calls = {}
    for rid, ref in refs.items():
        calls[rid] = w.decode.Generate(decode_pb2.GenerateRequest(
            request_id=rid, prompt_token_ids=ref.prompt, params=_params()), timeout=30)
        w.grants[rid] = next(calls[rid]).kv_target
        assert w.grants[rid].push_id == 1
    return calls


def _plane_push(w: Workers, rid: str, ref: Reference, push_id: int
                ) -> list[decode_pb2.KVStreamChunk]:
    """A whole data-plane push of `ref` as entries: header, KVWritten ranges, commit."""
    header = _header(rid, w.layout, ref)
    header.header.transport, header.header.push_id = w.transport, push_id
    return [_entry(rid, push_id, c)
            for c in (header, *_slabs(w.layout, ref.num_blocks, w), _commit(ref))]


def test_pushes_of_many_requests_share_one_stream_and_end_apart(workers: Workers) -> None:
    """Three requests' pushes interleaved on one call: one commits; one is cut by its entry and
    one is open when the call ends, and both keep their reservations (as a cancelled or broken
    PushKV leaves them); pushed again on a second call (KVTarget's newer push ids), they
    commit, every Generate decodes to its end and the blocks end free."""
    w = workers
    _data_plane_only(w)
    refs = {"many-a": w.long, "many-b": w.short, "many-c": w.long}
    calls = _open_many(w, refs)
    a, b, c = (_plane_push(w, rid, ref, 1) for rid, ref in refs.items())
    outcomes = _streams(w, [a[0], b[0], c[0]], [*a[1:3], *b[1:], c[1]],
                        [_entry("many-a", 1)])  # then the call ends with c open
    assert outcomes["many-b"].code == OK
    assert outcomes["many-b"].bytes_received == w.layout.num_layers * w.layout.cell_bytes()
    cut = {rid: (outcomes[rid].code, outcomes[rid].message) for rid in ("many-a", "many-c")}
    assert cut == {"many-a": (grpc.StatusCode.UNAVAILABLE.value[0],
                              "the push was cancelled by its sender"),
                   "many-c": (grpc.StatusCode.UNAVAILABLE.value[0],
                              "KV stream ended before every layer and block arrived")}
    # a and c keep their reservations; b, committed, leaves the waiting queue at the engine's
    # next step (a step away: under load it may still be queued when the call returns)
    deadline = time.monotonic() + 10
    while (load := _load(w.decode))[1] != 2:
        assert load[1] == 3 and time.monotonic() < deadline, f"decode load {load}"
        time.sleep(0.02)
    assert load[2] in (NUM_BLOCKS - 7, NUM_BLOCKS - 6)  # b decodes or is done
    again = [_plane_push(w, rid, refs[rid], _target(w, rid).push_id) for rid in ("many-a",
                                                                                 "many-c")]
    outcomes = _streams(w, [e for push in again for e in push])
    assert {rid: o.code for rid, o in outcomes.items()} == {"many-a": OK, "many-c": OK}
    for rid, call in calls.items():
        assert len([t for msg in call for t in msg.token_ids]) == len(refs[rid].tokens) - 1
    _wait_idle(w.decode)


def test_a_bad_push_on_a_shared_stream_fails_only_its_request(workers: Workers) -> None:
    """On one call: a push whose header names another layout fails its request (its Generate
    ends with the error, its blocks are freed after the write grace), a grpc push and a chunk
    of a push never opened are refused in their outcomes, and the request beside them commits."""
    w = workers
    _data_plane_only(w)
    refs = {"bad-layout": w.short, "beside-it": w.short}
    calls = _open_many(w, refs)
    bad = _plane_push(w, "bad-layout", w.short, 1)
    bad[0].chunk.header.layout.num_layers += 1
    grpc_header = _entry("grpc-push", 0, _header("grpc-push", w.layout, w.short))
    stray = _entry("never-opened", 1, _commit(w.short))
    outcomes = _streams(w, [grpc_header, stray, *bad, *_plane_push(w, "beside-it", w.short, 1)])
    invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert {rid: o.code for rid, o in outcomes.items()} == {
        "grpc-push": invalid, "never-opened": invalid, "bad-layout": invalid, "beside-it": OK}
    assert outcomes["grpc-push"].message == (
        "a grpc push's slabs travel on PushKV, not PushKVStreams")
    assert outcomes["never-opened"].message.startswith("no open push 1 of request 'never-opened'")
    assert "num_layers" in outcomes["bad-layout"].message
    assert _rpc_error(lambda: list(calls["bad-layout"])).code() != grpc.StatusCode.OK
    assert len([t for msg in calls["beside-it"] for t in msg.token_ids]) == len(w.short.tokens) - 1
    _freed(w)

