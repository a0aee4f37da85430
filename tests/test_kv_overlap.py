"""The KV push overlaps the prefill compute, between real worker processes over loopback gRPC.

One `pdserve prefill` and one `pdserve decode` on the bundled SmolLM2 (float32, a step budget
of 128 tokens): a prompt of about 700 tokens takes 6 prefill steps. The workers' own counters
show the overlap:

    prefill  kv_transfer_bytes_before_first_token     KV on the wire before the first token
             kv_transfer_first_token_to_commit_seconds   first token -> commit sent
    decode   kv_transfer_first_slab_to_commit_seconds    first slab in -> commit in

The decode worker got its first slab before the prefill worker sampled the first token when
its first-slab-to-commit span is longer than the prefill worker's first-token-to-commit time
plus the commit's trip (loopback: far below the margin asked for here, half the Prefill rpc).
Without overlap the span would be at most that. The tokens equal the colocated engine's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from cluster import free_port
from live_checks import metric
from worker_procs import spawn_worker, stop_all, wait_serving

from pdserve import SamplingParams
from pdserve.cluster.convert import sampling_params_to_pb
from protos import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

pytestmark = pytest.mark.slow

BUDGET = 128  # tokens per prefill step
MAX_TOKENS = 8
FLAGS = ["--dtype", "float32", "--max-num-batched-tokens", str(BUDGET), "--max-model-len", "1024",
         "--kv-cache-memory", str(128 << 20)]
TEXT = ("The history of the Roman Empire spans many centuries. It began when Augustus became "
        "the first emperor, and over the following years the empire grew to cover most of "
        "Europe, North Africa and the Middle East. ")
BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 4  # layers x (K, V) x tokens x kv heads x head dim x 4 B


@dataclass(frozen=True)
class Pair:
    prefill: prefill_pb2_grpc.PrefillStub
    decode: decode_pb2_grpc.DecodeStub
    decode_address: str
    prefill_metrics: str
    decode_metrics: str


@pytest.fixture(scope="module")
def pair(bundled_path: str) -> Iterator[Pair]:
    ports = [free_port() for _ in range(4)]
    prefill = spawn_worker("prefill", bundled_path, ports[0], *FLAGS,
                           "--metrics-port", str(ports[1]))
    decode = spawn_worker("decode", bundled_path, ports[2], *FLAGS,
                          "--metrics-port", str(ports[3]))
    try:
        paddr, daddr = f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[2]}"
        wait_serving(prefill, paddr)
        wait_serving(decode, daddr)
        with grpc.insecure_channel(paddr) as pch, grpc.insecure_channel(daddr) as dch:
            yield Pair(prefill_pb2_grpc.PrefillStub(pch), decode_pb2_grpc.DecodeStub(dch), daddr,
                       f"http://127.0.0.1:{ports[1]}/metrics",
                       f"http://127.0.0.1:{ports[3]}/metrics")
    finally:
        stop_all([prefill, decode])


@pytest.fixture(scope="module")
def reference(bundled_path: str) -> tuple[list[int], list[int]]:
    """(prompt, the colocated engine's greedy tokens), same step budget as the workers."""
    from pdserve import LLM

    llm = LLM(bundled_path, dtype="float32", max_num_batched_tokens=BUDGET, max_model_len=1024,
              kv_cache_memory=128 << 20)
    prompt = llm.get_tokenizer().encode(TEXT * 17)[:700]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                       use_tqdm=False)[0]
    return prompt, out.outputs[0].token_ids


def _counter(url: str, name: str) -> float:
    return metric(url, f"pdserve:{name}_total")


def test_the_push_overlaps_the_prefill_and_decodes_the_same_tokens(pair, reference) -> None:
    prompt, expected = reference
    assert math.ceil(len(prompt) / BUDGET) == 6
    params = sampling_params_to_pb(SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                                   MAX_TOKENS)
    call = pair.decode.Generate(decode_pb2.GenerateRequest(
        request_id="long", prompt_token_ids=prompt, params=params), timeout=120)
    assert next(call) == decode_pb2.GenerateResponse()  # blocks reserved
    started = time.monotonic()
    reply = pair.prefill.Prefill(prefill_pb2.PrefillRequest(
        request_id="long", prompt_token_ids=prompt, params=params,
        decode_address=pair.decode_address), timeout=120)
    prefill_s = time.monotonic() - started
    tokens = [reply.first_token_id, *(t for msg in call for t in msg.token_ids)]
    assert tokens == expected

    deadline = time.monotonic() + 10  # the prefill worker hears the reply after the client
    while _counter(pair.prefill_metrics, "kv_transfers") < 1:
        assert time.monotonic() < deadline, "the prefill worker never counted its push"
        time.sleep(0.05)
    kv_bytes = math.ceil(len(prompt) / 16) * BLOCK_BYTES
    assert _counter(pair.decode_metrics, "kv_transfer_bytes") == kv_bytes
    assert _counter(pair.prefill_metrics, "kv_transfer_bytes") == kv_bytes
    early = _counter(pair.prefill_metrics, "kv_transfer_bytes_before_first_token")
    # 5 of 6 chunks are computed before the last step; the last step's layer groups may all go
    # out before the first token is sampled too
    assert kv_bytes / 2 <= early <= kv_bytes
    tail_s = _counter(pair.prefill_metrics, "kv_transfer_first_token_to_commit_seconds")
    span_s = _counter(pair.decode_metrics, "kv_transfer_first_slab_to_commit_seconds")
    assert span_s > tail_s + prefill_s / 2, (span_s, tail_s, prefill_s)
