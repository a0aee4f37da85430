"""A prefill worker frees the KV it holds for a decode worker that never takes it, once the
lease (--kv-lease-seconds) runs out, and counts it in `pdserve:kv_lease_expired_total`.

A real `pdserve prefill` (tiny random Llama, 64 blocks of 16 tokens, a 2 s lease) pushes to the
fake decode worker of tests/worker_procs.py, which reads the header and one slab and then hangs,
never answering: without the lease the blocks would wait for the push's 60 s deadline.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest
from cluster import free_port
from live_checks import metric
from worker_procs import Proc, spawn_fake_decode, spawn_worker, stop_all, wait_serving

from pdserve import SamplingParams
from pdserve.cluster.convert import sampling_params_to_pb
from protos import common_pb2, prefill_pb2, prefill_pb2_grpc

pytestmark = pytest.mark.slow

NUM_BLOCKS = 64
LEASE_S = 2.0
PROMPT = list(range(1000, 1040))  # 40 tokens: 3 blocks


@pytest.fixture(scope="module")
def prefill(tiny_llama_dir: str) -> Iterator[tuple[prefill_pb2_grpc.PrefillStub, str]]:
    """The prefill worker's stub and its metrics URL."""
    port, metrics_port = free_port(), free_port()
    proc = spawn_worker("prefill", tiny_llama_dir, port, "--num-kv-blocks", str(NUM_BLOCKS),
                        "--dtype", "float32", "--kv-lease-seconds", str(LEASE_S),
                        "--metrics-port", str(metrics_port), "--kv-slab-bytes", "2048")
    try:
        wait_serving(proc, f"127.0.0.1:{port}")
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield prefill_pb2_grpc.PrefillStub(channel), f"http://127.0.0.1:{metrics_port}/metrics"
    finally:
        stop_all([proc])


def _blocks_in_use(stub: prefill_pb2_grpc.PrefillStub) -> int:
    load = stub.GetLoad(common_pb2.GetLoadRequest(), timeout=5)
    return load.num_total_blocks - load.num_free_blocks


def _prefill(stub: prefill_pb2_grpc.PrefillStub, request_id: str, decode_address: str) -> None:
    params = sampling_params_to_pb(SamplingParams(temperature=0, max_tokens=8), 8)
    reply = stub.Prefill(prefill_pb2.PrefillRequest(
        request_id=request_id, prompt_token_ids=PROMPT, params=params,
        decode_address=decode_address), timeout=30)
    assert reply.finish_reason == ""


def test_kv_never_claimed_is_freed_when_its_lease_runs_out(prefill) -> None:
    stub, metrics_url = prefill
    _prefill(stub, "no-push", "")  # nothing to ship: freed at once, no lease involved
    assert _blocks_in_use(stub) == 0
    port = free_port()
    fake: Proc = spawn_fake_decode(port, chunks=1, then="hang")
    try:
        started = time.monotonic()
        _prefill(stub, "unclaimed", f"127.0.0.1:{port}")
        assert [fake.next_event()["event"] for _ in range(3)] == ["header", "data", "breaking"]
        assert _blocks_in_use(stub) == 3  # held: the push is stuck, the lease is running
        while _blocks_in_use(stub):
            assert time.monotonic() - started < LEASE_S + 10, "the lease never expired"
            time.sleep(0.1)
        assert time.monotonic() - started >= LEASE_S
        assert fake.popen.poll() is None  # the decode worker never answered: still hanging
        assert metric(metrics_url, "pdserve:kv_lease_expired_total") == 1
    finally:
        fake.popen.kill()
        fake.popen.wait()


def test_a_push_whose_reservation_is_never_told_is_freed_when_its_lease_runs_out(
        prefill) -> None:
    """A Prefill sent beside the decode worker's reservation (decode_reservation_pending) whose
    Reserved never comes (its gateway gave up): its push never starts, its blocks go with the
    lease. A Reserved for a request that never came here is kept, and found by nobody."""
    stub, metrics_url = prefill
    expired = metric(metrics_url, "pdserve:kv_lease_expired_total")
    told = stub.Reserved(prefill_pb2.ReservedRequest(request_id="never-prefilled"), timeout=5)
    assert not told.found
    params = sampling_params_to_pb(SamplingParams(temperature=0, max_tokens=8), 8)
    started = time.monotonic()
    reply = stub.Prefill(prefill_pb2.PrefillRequest(
        request_id="never-told", prompt_token_ids=PROMPT, params=params,
        decode_address=f"127.0.0.1:{free_port()}", decode_reservation_pending=True), timeout=30)
    assert reply.finish_reason == ""
    assert _blocks_in_use(stub) == 3
    while _blocks_in_use(stub):
        assert time.monotonic() - started < LEASE_S + 10, "the lease never expired"
        time.sleep(0.1)
    assert metric(metrics_url, "pdserve:kv_lease_expired_total") == expired + 1
