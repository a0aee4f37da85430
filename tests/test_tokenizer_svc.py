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


@pytest.mark.parametrize("shared", [True, False])
def test_the_gateway_s_calls_on_one_kept_open_call_answer_as_their_own(
        bundled_path, bundled_tokenizer, shared):
    """RemoteTokenizer's Tokenize and ApplyChatTemplate as messages on one TokenizeStreams call
    (`shared`) or a call each: the same ids, several at once, the same errors."""
    asyncio.run(_remote(bundled_path, bundled_tokenizer, shared, streams=True))


def test_a_service_without_the_kept_open_call_gets_a_call_each(bundled_path, bundled_tokenizer):
    asyncio.run(_remote(bundled_path, bundled_tokenizer, True, streams=False))


async def _remote(path: str, tok, shared: bool, streams: bool) -> None:
    from earlier_peer import add_unary_methods

    from gateway.backend import BackendError
    from gateway.remote_tokenizer import RemoteTokenizer

    servicer = TokenizerServicer(TokenizerModel(path, "smol", max_model_len=1024))

    def add(server: grpc.aio.Server) -> None:
        if streams:
            tokenizer_pb2_grpc.add_TokenizerServicer_to_server(servicer, server)
            return
        add_unary_methods(server, "pdserve.v1.Tokenizer", servicer, [
            ("Tokenize", tokenizer_pb2.TokenizeRequest, tokenizer_pb2.TokenizeResponse),
            ("ApplyChatTemplate", tokenizer_pb2.ChatTemplateRequest,
             tokenizer_pb2.TokenizeResponse),
            ("GetModelInfo", tokenizer_pb2.ModelInfoRequest, tokenizer_pb2.ModelInfo)])

    server, _ = await make_server("pdserve.v1.Tokenizer", add)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    remote = RemoteTokenizer(f"127.0.0.1:{port}", shared=shared)
    try:
        await remote.start()
        texts = [f"prompt {i}: ünïcödé and 漢字 🙂" * (i + 1) for i in range(6)]
        ids = await asyncio.gather(*(remote.tokenize(t) for t in texts),
                                   remote.apply_chat_template(CHAT))
        assert ids[:-1] == [tok.encode(t) for t in texts]
        assert ids[-1] == list(tok.apply_chat_template(CHAT, add_generation_prompt=True,
                                                       return_dict=False))
        with pytest.raises(ValueError):  # INVALID_ARGUMENT, as its own call would end
            await remote.apply_chat_template([])
        assert remote.shared == (shared and streams)  # fell back where the service lacks it
        assert (remote._streams is not None) == shared
        if shared and streams:  # the service stops: its idle kept-open call ends at once,
            servicer.stopping.set()  # and a call sent meanwhile is refused, retryable
            for _ in range(300):
                if remote._streams.failed is not None:
                    break
                await asyncio.sleep(0.01)
            assert remote._streams.failed.code() == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(BackendError) as err:  # the new call ends, or refuses it
                await remote.tokenize("late")
            assert err.value.retryable and "tokenizer service" in str(err.value)
    finally:
        await remote.close()
        await server.stop(0)
