"""gRPC over TLS on loopback with throw-away certificates: the tokenizer service answers a TLS
client and refuses a plaintext one; with a CA configured the server requires client
certificates (the prefill -> decode KV push included); the flags read their environment
fallbacks."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from tls_certs import Certs, make_certs

from pdserve.cluster.flags import add_common_flags
from pdserve.cluster.grpc_server import check_health, make_server, open_channel, set_serving
from pdserve.cluster.tls import PLAINTEXT, TLSConfig, listen, tls_from_args
from prefill_svc.sender import PushKVSender
from protos import decode_pb2, decode_pb2_grpc, tokenizer_pb2, tokenizer_pb2_grpc
from tokenizer_svc.service import TokenizerModel, TokenizerServicer


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("tls"))


@asynccontextmanager
async def serving(
    name: str, add: Callable[[grpc.aio.Server], None], tls: TLSConfig
) -> AsyncIterator[str]:
    """A pdserve gRPC server (`add` puts the servicer on it) on a loopback port over `tls`."""
    server, health = await make_server(name, add)
    port = listen(server, "127.0.0.1:0", tls)
    await server.start()
    await set_serving(health, name)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


async def tokenize(address: str, tls: TLSConfig) -> list[int]:
    async with open_channel(address, tls) as channel:
        stub = tokenizer_pb2_grpc.TokenizerStub(channel)
        reply = await stub.Tokenize(tokenizer_pb2.TokenizeRequest(text="Hello TLS"), timeout=5)
    return list(reply.token_ids)


async def test_tokenizer_over_tls_refuses_plaintext(
    certs: Certs, bundled_path: str, bundled_tokenizer: Any
) -> None:
    servicer = TokenizerServicer(TokenizerModel(bundled_path, "smol"))
    server_tls = TLSConfig(certs.server_cert, certs.server_key)
    add = lambda s: tokenizer_pb2_grpc.add_TokenizerServicer_to_server(servicer, s)
    async with serving("pdserve.v1.Tokenizer", add, server_tls) as address:
        client = TLSConfig(ca=certs.ca)
        assert await tokenize(address, client) == bundled_tokenizer.encode("Hello TLS")
        assert await check_health(address, tls=client)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await tokenize(address, PLAINTEXT)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert not await check_health(address)
        # A client that trusts only the system's roots does not trust our CA.
        untrusting = TLSConfig(certs.client_cert, certs.client_key)
        assert not await check_health(address, tls=untrusting)


class CountingDecode(decode_pb2_grpc.DecodeServicer):
    """A decode worker's PushKV that only counts the bytes it receives."""

    async def PushKV(self, request_iterator: Any, context: Any) -> decode_pb2.PushKVResponse:
        total = 0
        async for chunk in request_iterator:
            total += len(chunk.data.data) if chunk.HasField("data") else 0
        return decode_pb2.PushKVResponse(bytes_received=total)


async def test_mutual_tls_kv_push(certs: Certs) -> None:
    """A server given --tls-ca accepts only clients with a certificate that CA signed: the
    prefill worker's KV push goes through with one and is refused without."""
    server_tls = TLSConfig(certs.server_cert, certs.server_key, certs.ca)
    add = lambda s: decode_pb2_grpc.add_DecodeServicer_to_server(CountingDecode(), s)
    caches = [torch.randn(2, 4, 4, 2, 8) for _ in range(3)]  # 3 layers, 4 blocks of 4 tokens
    expected = 3 * 3 * 2 * 4 * 2 * 8 * 4  # layers x blocks x (K, V) x tokens x heads x dim x 4 B
    async with serving("pdserve.v1.Decode", add, server_tls) as address:
        prefill = TLSConfig(certs.client_cert, certs.client_key, certs.ca)
        sender = PushKVSender(caches, slab_bytes=1024, tls=prefill)
        push = sender.new_push("r1", num_tokens=10).computed([2, 0, 3], first_token_id=7)
        assert await sender.send(address, push) == expected
        await sender.close()
        anonymous = PushKVSender(caches, tls=TLSConfig(ca=certs.ca))
        push = anonymous.new_push("r1", num_tokens=10).computed([2, 0, 3], first_token_id=7)
        with pytest.raises(ConnectionError):
            await anonymous.send(address, push)
        await anonymous.close()
        assert not await check_health(address, tls=TLSConfig(ca=certs.ca))
        assert await check_health(address, tls=prefill)


async def test_one_shared_certificate_verified_by_name_not_address(tmp_path: Path) -> None:
    """Workers are dialled at addresses known only once they run (pod IPs): with
    --tls-server-name every client checks each server's certificate against that fixed name, so
    one certificate shared by every service verifies every hop. Without it, or with another
    name, the connection is refused: the check is not switched off."""
    shared = make_certs(tmp_path, server_dns_names=["pdserve-internal"])
    server_tls = TLSConfig(shared.server_cert, shared.server_key, shared.ca)
    add = lambda s: decode_pb2_grpc.add_DecodeServicer_to_server(CountingDecode(), s)
    caches = [torch.randn(2, 4, 4, 2, 8)]
    client = TLSConfig(shared.client_cert, shared.client_key, shared.ca)
    async with serving("pdserve.v1.Decode", add, server_tls) as address:  # 127.0.0.1:port
        named = dataclasses.replace(client, server_name="pdserve-internal")
        assert await check_health(address, tls=named)
        sender = PushKVSender(caches, tls=named)
        push = sender.new_push("r1", num_tokens=4).computed([1], first_token_id=7)
        assert await sender.send(address, push) == 2 * 4 * 2 * 8 * 4
        await sender.close()
        assert not await check_health(address, tls=client)  # 127.0.0.1 is not in it
        wrong = dataclasses.replace(client, server_name="pdserve-elsewhere")
        assert not await check_health(address, tls=wrong)


async def test_tls_config_rules(certs: Certs) -> None:
    with pytest.raises(ValueError, match="together"):
        TLSConfig(cert=certs.server_cert)
    with pytest.raises(ValueError, match="--tls-server-name needs TLS"):
        TLSConfig(server_name="pdserve-internal")
    server = grpc.aio.server()
    with pytest.raises(ValueError, match="needs --tls-cert"):  # never a silent plaintext server
        listen(server, "127.0.0.1:0", TLSConfig(ca=certs.ca))
    assert not PLAINTEXT.enabled and TLSConfig(ca=certs.ca).enabled


def test_tls_flags_read_their_environment(
    certs: Certs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_TLS_CERT", certs.server_cert)
    monkeypatch.setenv("PDSERVE_TLS_KEY", certs.server_key)
    monkeypatch.setenv("PDSERVE_TLS_CA", certs.ca)
    monkeypatch.setenv("PDSERVE_TLS_SERVER_NAME", "pdserve-internal")
    parser = argparse.ArgumentParser()
    add_common_flags(parser, 1234)
    assert tls_from_args(parser.parse_args([])) == TLSConfig(
        certs.server_cert, certs.server_key, certs.ca, "pdserve-internal")
    overridden = parser.parse_args(["--tls-ca", str(tmp_path / "other.pem")])
    assert tls_from_args(overridden).ca == str(tmp_path / "other.pem")
