"""The tokenizer service over real gRPC (in-process server on loopback)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from gateway.remote_tokenizer import tokenizer_from_info
from pdserve.cluster.grpc_server import check_health, make_server, open_channel, set_serving
from protos import tokenizer_pb2, tokenizer_pb2_grpc
from tokenizer_svc.service import TokenizerModel, TokenizerServicer

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]


def test_tokenizer_service(bundled_path, bundled_tokenizer):
    asyncio.run(_exercise(bundled_path, bundled_tokenizer))


async def _exercise(path: str, tok) -> None:
    model = TokenizerModel(path, "smol", max_model_len=1024)
    server, health = await make_server(
        "pdserve.v1.Tokenizer",
        lambda s: tokenizer_pb2_grpc.add_TokenizerServicer_to_server(TokenizerServicer(model), s),
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    address = f"127.0.0.1:{port}"
    try:
        assert not await check_health(address)  # NOT_SERVING until the model is loaded
        await set_serving(health, "pdserve.v1.Tokenizer")
        assert await check_health(address)
        async with open_channel(address) as channel:
            await _check_rpcs(tokenizer_pb2_grpc.TokenizerStub(channel), tok)
    finally:
        await server.stop(0)


async def _check_rpcs(stub: tokenizer_pb2_grpc.TokenizerStub, tok) -> None:
    text = "Paged attention, ünïcödé and 漢字 🙂"
    r = await stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=text, add_special_tokens=True))
    assert list(r.token_ids) == tok.encode(text)
    chat = await stub.ApplyChatTemplate(tokenizer_pb2.ChatTemplateRequest(
        messages=[tokenizer_pb2.ChatMessage(**m) for m in CHAT], add_generation_prompt=True))
    assert list(chat.token_ids) == list(tok.apply_chat_template(
        CHAT, add_generation_prompt=True, return_dict=False))
    d = await stub.Detokenize(tokenizer_pb2.DetokenizeRequest(token_ids=r.token_ids))
    assert d.text == text
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Detokenize(tokenizer_pb2.DetokenizeRequest(token_ids=[10**8]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "outside the vocabulary" in err.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.ApplyChatTemplate(tokenizer_pb2.ChatTemplateRequest(messages=[]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    info = await stub.GetModelInfo(tokenizer_pb2.ModelInfoRequest())
    assert (info.model_name, info.max_model_len, info.has_chat_template) == ("smol", 1024, True)
    assert 2 in info.eos_token_ids and info.vocab_size == 49152
    local = tokenizer_from_info(info)  # what the gateway rebuilds for detokenization
    ids = list(chat.token_ids) + list(r.token_ids)
    assert local.decode(ids, skip_special_tokens=True) == tok.decode(ids, skip_special_tokens=True)
    assert local.decode(ids) == tok.decode(ids)
