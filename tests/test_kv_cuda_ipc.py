"""The cuda_ipc KV data plane between two real worker processes sharing one GPU (GPU only;
skipped on CPU). The prefill worker maps the decode worker's KV pool by its CUDA IPC handle and
copies its blocks straight into the reserved ones; PushKV carries the header, KVWritten ranges
and the commit.

    tokens      disaggregated over cuda_ipc == colocated `LLM.generate`, greedy (the 4-layer
                test model in fp32, the 1B-shaped random model in bf16), and the decode
                worker's bytes counted under transport="cuda_ipc", none under grpc
    restart     a decode worker restarted on the same port has a new pool: the prefill worker's
                cached handle is refused (KVTarget FAILED_PRECONDITION) before it writes, that
                push goes over grpc, and the next one maps the new pool
    engine core each worker's engine in a process of its own (--engine-core auto, the
                default on a GPU, as the other tests run): tokens equal colocated over cuda_ipc
                (the pool exported by the decode core, written from the pool the prefill core
                shares) and over grpc (the decode worker's server writes the pool opened by the
                handle); both engines in their worker's thread (--engine-core thread) too
    kills       a prefill worker killed while it pushes, a decode worker killed while it
                receives: the survivor ends with every block free (SIGKILL lands wherever the
                push is by then; on a GPU the whole push takes a few ms, so "mid-write" is not
                guaranteed, only that no outcome leaks)
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
import torch
from cluster import free_port, http_get
from worker_procs import Proc, spawn_worker, stop_all, wait_serving

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from pdserve.cluster.convert import sampling_params_to_pb  # noqa: E402
from pdserve.cluster.grpc_server import GRPC_OPTIONS  # noqa: E402
from protos import (  # noqa: E402
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)

NUM_BLOCKS = 256
MAX_TOKENS = 16
PREFILL_CHUNK = 128  # the prefill worker's --max-num-batched-tokens, and the reference's
# every engine's, so that each captures the same decode graphs and runs a chunk as decode rows
# or eagerly alike (in bf16 the two part a random model's near-ties)
MAX_NUM_SEQS = 256
GRACE_S = 0.5


@dataclass
class Worker:
    role: str
    model: str
    flags: tuple[str, ...]
    port: int
    metrics_port: int
    proc: Proc | None = None
    channel: grpc.Channel | None = None
    env: dict[str, str] | None = None  # over the test's environment (CUDA_VISIBLE_DEVICES)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> Worker:
        self.proc = spawn_worker(self.role, self.model, self.port, *self.flags,
                                 "--metrics-port", str(self.metrics_port), env=self.env)
        return self

    def ready(self) -> Worker:
        assert self.proc is not None
        wait_serving(self.proc, self.address, timeout_s=300)
        self.channel = grpc.insecure_channel(self.address, options=GRPC_OPTIONS)
        return self

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.popen.send_signal(signal.SIGKILL)
        self.proc.popen.wait(timeout=30)
        if self.channel is not None:
            self.channel.close()

    def stub(self):
        stub = prefill_pb2_grpc.PrefillStub if self.role == "prefill" else \
            decode_pb2_grpc.DecodeStub
        return stub(self.channel)

    def counter(self, name: str, **labels: str) -> float:
        from prometheus_client.parser import text_string_to_metric_families

        _, text = http_get(f"http://127.0.0.1:{self.metrics_port}/metrics")
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == f"pdserve:{name}_total"
                   and all(s.labels.get(k) == v for k, v in labels.items()))

    def load(self) -> tuple[int, int, int, int]:
        w = self.stub().GetLoad(common_pb2.GetLoadRequest(), timeout=10)
        return w.num_running, w.num_waiting, w.num_free_blocks, w.num_total_blocks

    def wait_idle(self, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while (load := self.load()) != (0, 0, NUM_BLOCKS, NUM_BLOCKS):
            assert time.monotonic() < deadline, f"{self.role} not idle: {load}"
            time.sleep(0.05)


def _pair(model: str, dtype: str, gpus: tuple[str, str] | None = None,
          decode_flags: tuple[str, ...] = (),
          prefill_flags: tuple[str, ...] = ()) -> tuple[Worker, Worker]:
    """A prefill and a decode worker over cuda_ipc; `gpus`: (prefill's, decode's) GPU, each
    worker seeing its own first and the other's after it, as `pdserve up --prefill-gpus
    --decode-gpus` starts them (None: both on the test's first GPU); `decode_flags` and
    `prefill_flags` last on each worker's command line."""
    common = ("--device", "cuda", "--dtype", dtype, "--num-kv-blocks", str(NUM_BLOCKS),
              "--max-num-seqs", str(MAX_NUM_SEQS), "--kv-transport", "cuda_ipc")
    envs: list[dict[str, str] | None] = [None, None]
    if gpus is not None:
        envs = [{"CUDA_VISIBLE_DEVICES": f"{gpus[0]},{gpus[1]}"},
                {"CUDA_VISIBLE_DEVICES": f"{gpus[1]},{gpus[0]}"}]
    prefill = Worker("prefill", model, (*common, "--max-num-batched-tokens", str(PREFILL_CHUNK),
                                        *prefill_flags), free_port(), free_port(), env=envs[0])
    decode = Worker("decode", model, (*common, "--kv-write-grace-seconds", str(GRACE_S),
                                      "--kv-timeout", "10", *decode_flags), free_port(),
                    free_port(), env=envs[1])
    return prefill.start(), decode.start()


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(10, vocab - 10, (n,), generator=gen).tolist() for n in (5, 40, 700)]


def _reference(model: str, dtype: str, prompts: list[list[int]]) -> list[list[int]]:
    """Colocated greedy tokens, one prompt at a time and in the prefill worker's chunks, as the
    pair serves them here (in bf16 a batch of three decodes, or a 700-token prompt in one
    chunk, goes through other GEMM tilings than a batch of one or 128-token chunks, and a
    random model's near-ties then split: on an H200 a 700-token prompt in one chunk parted
    from the pair's at its third token; on an H100, the chunks run eagerly here (graphs up to
    LLM's 64 rows) and as decode rows in the workers (up to 512), at the eighth)."""
    from pdserve import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, device="cuda", num_kv_blocks=NUM_BLOCKS,
              max_num_batched_tokens=PREFILL_CHUNK, max_num_seqs=MAX_NUM_SEQS)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tokens = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    del llm
    torch.cuda.empty_cache()
    return tokens


def _disaggregated(prefill: Worker, decode: Worker, rid: str, prompt: list[int]) -> list[int]:
    try:
        return _generate(prefill, decode, rid, prompt)
    except grpc.RpcError as exc:  # say what the workers said
        tails = "\n".join(f"---- {w.role}\n{w.proc.tail(60)}" for w in (prefill, decode)
                          if w.proc is not None)
        raise AssertionError(f"request {rid!r} failed: {exc}\n{tails}") from exc


def _generate(prefill: Worker, decode: Worker, rid: str, prompt: list[int]) -> list[int]:
    from pdserve import SamplingParams

    params = sampling_params_to_pb(
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), MAX_TOKENS)
    call, reserved = _reserve(decode, rid, prompt, params)
    reply = prefill.stub().Prefill(_prefill_request(rid, prompt, params, decode, reserved),
                                   timeout=120)
    return [reply.first_token_id, *(t for msg in call for t in msg.token_ids)]


def _reserve(decode: Worker, rid: str, prompt: list[int], params: common_pb2.SamplingParams):
    """Generate up to its first message (blocks reserved), as the gateway opens it: the call
    and that message (the blocks its prefix cache holds; their grant to a data-plane push,
    absent before the pool's handle was exported)."""
    call = decode.stub().Generate(decode_pb2.GenerateRequest(
        request_id=rid, prompt_token_ids=prompt, params=params), timeout=120)
    first = next(call)
    assert not first.token_ids and not first.finish_reason
    return call, first


def _prefill_request(rid: str, prompt: list[int], params: common_pb2.SamplingParams,
                     decode: Worker, reserved: decode_pb2.GenerateResponse) -> Any:
    """The Prefill the gateway sends after `reserved`: skip what the decode worker holds, write
    into the granted blocks."""
    return prefill_pb2.PrefillRequest(
        request_id=rid, prompt_token_ids=prompt, params=params, decode_address=decode.address,
        decode_cached_blocks=reserved.cached_blocks,
        decode_kv_target=reserved.kv_target if reserved.HasField("kv_target") else None)


def _kv_bytes(prompt: list[int], block_bytes: int) -> int:
    return -(-len(prompt) // 16) * block_bytes


def _block_bytes(model: str, dtype: str) -> int:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    elem = 4 if dtype == "float32" else 2
    return 2 * cfg.num_hidden_layers * 16 * cfg.num_key_value_heads * head_dim * elem


@pytest.fixture(scope="module")
def model_dir(cuda_llama_dir: str) -> str:
    return cuda_llama_dir


@pytest.fixture(scope="module")
def pair(model_dir: str) -> Iterator[tuple[Worker, Worker, list[list[int]], list[list[int]]]]:
    prefill, decode = _pair(model_dir, "float32")
    try:
        prompts = _prompts(49152)
        ref = _reference(model_dir, "float32", prompts)
        yield prefill.ready(), decode.ready(), prompts, ref
    finally:
        stop_all([w.proc for w in (prefill, decode) if w.proc is not None])


def _check_equal_over_ipc(prefill: Worker, decode: Worker, prompts: list[list[int]],
                          ref: list[list[int]], block_bytes: int, tag: str) -> None:
    ipc, grpc_bytes = (decode.counter("kv_transfer_bytes", transport=t)
                       for t in ("cuda_ipc", "grpc"))
    for i, (prompt, expected) in enumerate(zip(prompts, ref)):
        assert _disaggregated(prefill, decode, f"{tag}-{i}", prompt) == expected
    moved = sum(_kv_bytes(p, block_bytes) for p in prompts)
    assert decode.counter("kv_transfer_bytes", transport="cuda_ipc") - ipc == moved
    assert decode.counter("kv_transfer_bytes", transport="grpc") == grpc_bytes
    prefill.wait_idle()
    decode.wait_idle()


def test_tokens_equal_colocated_over_cuda_ipc(pair, model_dir: str) -> None:
    prefill, decode, prompts, ref = pair
    _check_equal_over_ipc(prefill, decode, prompts, ref, _block_bytes(model_dir, "float32"),
                          "ipc")


def test_a_restarted_decode_worker_refuses_the_stale_handle_then_maps_anew(pair) -> None:
    prefill, decode, prompts, ref = pair
    assert _disaggregated(prefill, decode, "before-restart", prompts[1]) == ref[1]
    decode.wait_idle()
    decode.kill()
    decode.start().ready()
    stale = prefill.counter("kv_transfer_stale_pools")
    assert _disaggregated(prefill, decode, "after-restart", prompts[1]) == ref[1]
    assert prefill.counter("kv_transfer_stale_pools") == stale + 1
    assert decode.counter("kv_transfers", transport="grpc") == 1  # that push: over grpc
    assert decode.counter("kv_transfers", transport="cuda_ipc") == 0
    assert _disaggregated(prefill, decode, "remapped", prompts[1]) == ref[1]
    assert decode.counter("kv_transfers", transport="cuda_ipc") == 1
    granted = prefill.counter("kv_transfer_granted_pushes")
    assert _disaggregated(prefill, decode, "granted", prompts[1]) == ref[1]
    assert prefill.counter("kv_transfer_granted_pushes") == granted + 1  # no KVTarget rpc
    prefill.wait_idle()
    decode.wait_idle()


@pytest.mark.parametrize(("core", "transport"), [
    ("process", "cuda_ipc"), ("process", "grpc"), ("thread", "cuda_ipc")])
def test_each_engine_core_placement_equals_colocated(model_dir: str, core: str,
                                                     transport: str) -> None:
    """Both workers' `--engine-core process` (decode_svc/engine_core.py,
    prefill_svc/engine_core.py): over cuda_ipc the prefill worker pushes from the pool its
    engine core process shares into the pool the decode core allocated and exported; over grpc
    (the decode worker offering nothing else) the decode worker's server writes the slabs into
    that pool opened by its CUDA IPC handle. `thread`: both engines in their worker's process.
    Tokens equal colocated, bytes under the transport, every block free afterwards."""
    prompts = _prompts(49152)
    ref = _reference(model_dir, "float32", prompts)
    prefill, decode = _pair(model_dir, "float32", decode_flags=(
        "--engine-core", core, "--kv-transport", transport), prefill_flags=("--engine-core", core))
    try:
        prefill.ready(), decode.ready()
        for i, (prompt, expected) in enumerate(zip(prompts, ref)):
            assert _disaggregated(prefill, decode, f"core-{transport}-{i}", prompt) == expected
        moved = sum(_kv_bytes(p, _block_bytes(model_dir, "float32")) for p in prompts)
        assert decode.counter("kv_transfer_bytes", transport=transport) == moved
        prefill.wait_idle()
        decode.wait_idle()
    finally:
        stop_all([w.proc for w in (prefill, decode) if w.proc is not None])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_across_two_gpus_the_kernel_writes_the_peer_pool_and_tokens_equal_colocated(
        model_dir: str) -> None:
    """Prefill on GPU 0, decode on GPU 1: the decode worker's pool, opened in GPU 0's context,
    is written by the block-copy kernel in one pass (its probe passed: the prefill worker says
    so), and the tokens equal colocated."""
    prompts = _prompts(49152)
    ref = _reference(model_dir, "float32", prompts)
    prefill, decode = _pair(model_dir, "float32", gpus=("0", "1"))
    try:
        prefill.ready(), decode.ready()
        _check_equal_over_ipc(prefill, decode, prompts, ref, _block_bytes(model_dir, "float32"),
                              "2gpu")
        assert prefill.proc is not None
        assert "written by the kernel" in prefill.proc.tail(10_000), prefill.proc.tail(60)
    finally:
        stop_all([w.proc for w in (prefill, decode) if w.proc is not None])


def _start_push(prefill: Worker, decode: Worker, rid: str, prompt: list[int]):
    from pdserve import SamplingParams

    params = sampling_params_to_pb(
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), MAX_TOKENS)
    call, reserved = _reserve(decode, rid, prompt, params)
    future = prefill.stub().Prefill.future(
        _prefill_request(rid, prompt, params, decode, reserved), timeout=120)
    return call, future


def test_a_prefill_worker_killed_while_pushing_leaves_nothing_reserved(pair) -> None:
    prefill, decode, prompts, _ = pair
    call, future = _start_push(prefill, decode, "prefill-killed", prompts[2])
    time.sleep(0.005)
    prefill.kill()
    # the decode worker keeps the reservation for a retried prefill until Generate goes
    call.cancel()
    decode.wait_idle(timeout_s=20)
    with contextlib.suppress(grpc.RpcError):
        future.result()  # the kill may land after the first token (a 700-token prompt's
        # chunks replayed as decode rows took ~15 ms on an H100)
    prefill.start().ready()
    prefill.wait_idle()


def test_a_decode_worker_killed_while_receiving_frees_the_prefill_blocks(pair) -> None:
    prefill, decode, prompts, ref = pair
    call, future = _start_push(prefill, decode, "decode-killed", prompts[2])
    time.sleep(0.005)
    decode.kill()
    with contextlib.suppress(grpc.RpcError):
        future.result()  # the first token may or may not have come back
    prefill.wait_idle(timeout_s=40)  # the push failed: its blocks are freed
    decode.start().ready()
    assert _disaggregated(prefill, decode, "after-decode-death", prompts[1]) == ref[1]
    prefill.wait_idle()
    decode.wait_idle()


def test_the_1b_shaped_model_over_cuda_ipc_equals_colocated(tmp_path) -> None:
    """The 1B-shaped random model of `pdserve bench gpu` (16 layers, 32/8 heads, head_dim 64,
    bf16): tokens equal colocated, bytes over cuda_ipc."""
    from pdserve.bench.gpu_model import ModelShape, save_random_model, save_stand_in_tokenizer

    shape = ModelShape()
    save_random_model(shape, tmp_path, seed=0, device=torch.device("cuda"))
    save_stand_in_tokenizer(shape.vocab, tmp_path)
    torch.cuda.empty_cache()
    model = str(tmp_path)
    prefill, decode = _pair(model, "bfloat16")
    try:
        prompts = _prompts(shape.vocab)
        ref = _reference(model, "bfloat16", prompts)
        prefill.ready(), decode.ready()
        _check_equal_over_ipc(prefill, decode, prompts, ref, _block_bytes(model, "bfloat16"),
                              "1b")
    finally:
        stop_all([w.proc for w in (prefill, decode) if w.proc is not None])
