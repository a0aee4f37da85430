"""Fuzz the gRPC edges with random protobuf messages (hypothesis): each converter and the checks
right behind it either succeed or raise ValueError, which the shared interceptor answers with
INVALID_ARGUMENT. Anything else would be an INTERNAL error, or a crash, for a client's mistake.

Covered: sampling params (prefill and decode workers; their structured-output constraint
and prompt_logprobs survive the wire), KV layout, KV slabs written into a real (tiny) cache,
first-token logprobs, the prefill response's prompt logprobs,
and the tokenizer service's rpcs.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pb_strategies import messages, structured_outputs

from decode_svc.convert import first_logprobs, layout_from_pb, slab_from_pb
from engine.kv_transfer import KVLayout, KVSlab, KVSlabWriter
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.structured.params import StructuredOutputsParams
from pdserve.cluster.convert import (
    logprobs_from_pb,
    prompt_logprob_to_pb,
    prompt_logprobs_from_pb,
    sampling_params_from_pb,
    sampling_params_to_pb,
)
from pdserve.cluster.grpc_server import status_for
from protos import common_pb2, decode_pb2, prefill_pb2, tokenizer_pb2
from tokenizer_svc.convert import messages_from_pb
from tokenizer_svc.service import TokenizerModel, TokenizerServicer

FUZZ = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])
# A receiver's cache: 2 layers of [2 (K, V), 6 blocks, block_size 4, 2 kv heads, head dim 4].
LAYERS, BLOCKS, SHAPE = 2, 6, (2, 6, 4, 2, 4)
CELL = 2 * 4 * 2 * 4 * 4  # bytes of one layer x one block


def test_value_error_is_invalid_argument() -> None:
    assert status_for(ValueError("bad")) == grpc.StatusCode.INVALID_ARGUMENT


@FUZZ
@given(messages(common_pb2.SamplingParams))
def test_sampling_params_from_pb(msg: common_pb2.SamplingParams) -> None:
    try:
        params = sampling_params_from_pb(msg)
    except ValueError:
        return
    assert params.max_tokens == msg.max_tokens >= 1 and params.min_tokens <= params.max_tokens
    assert params.output_kind is RequestOutputKind.DELTA and not params.detokenize
    assert params.seed == (msg.seed if msg.HasField("seed") else None)
    again = sampling_params_from_pb(sampling_params_to_pb(params, params.max_tokens))
    assert again.max_tokens == params.max_tokens  # a worker can pass it on
    assert again.structured_outputs == params.structured_outputs
    assert again.logit_bias == params.logit_bias == (dict(msg.logit_bias) or None)
    assert again.allowed_token_ids == params.allowed_token_ids
    assert again.bad_words == params.bad_words == (list(msg.bad_words) or None)
    assert again.prompt_logprobs == params.prompt_logprobs == (
        msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None)
    so = params.structured_outputs
    sent = msg.structured_output.kind if msg.HasField("structured_output") else None
    assert (so.kind if so is not None else None) == sent


@FUZZ
@given(structured_outputs())
def test_structured_outputs_survive_the_wire(so: StructuredOutputsParams) -> None:
    """The constraint a gateway sends is the one a worker reads (and sends on): same kind, same
    spec, through the bytes."""
    params = SamplingParams(max_tokens=4, structured_outputs=so)
    wire = sampling_params_to_pb(params, 4).SerializeToString()
    received = sampling_params_from_pb(common_pb2.SamplingParams.FromString(wire))
    got = received.structured_outputs
    assert got is not None and (got.kind, got.spec()) == (so.kind, so.spec())
    resent = sampling_params_from_pb(sampling_params_to_pb(received, 4)).structured_outputs
    assert resent == got
    assert sampling_params_from_pb(sampling_params_to_pb(params.clone(structured_outputs=None),
                                                         4)).structured_outputs is None


@FUZZ
@given(messages(decode_pb2.KVLayout))
def test_kv_layout_check(msg: decode_pb2.KVLayout) -> None:
    mine = KVLayout(LAYERS, 2, 4, "float32", 4)
    try:
        mine.check_compatible(layout_from_pb(msg))
    except ValueError as exc:
        assert str(exc).startswith("KV layout mismatch: ")
        return
    assert layout_from_pb(msg) == mine


def _slabs() -> st.SearchStrategy[decode_pb2.KVData]:
    """Random slabs, a good share of them well-formed: ranges near the cache's, and data of
    the size the range needs, one byte off, or anything."""
    near = st.integers(0, BLOCKS + 1)

    def build(l0: int, l1: int, b0: int, b1: int, size: st.DataObject) -> decode_pb2.KVData:
        exact = max(l1 - l0, 0) * max(b1 - b0, 0) * CELL
        nbytes = size.draw(st.sampled_from([exact, exact, max(exact - 1, 0), exact + 1, 7]))
        return decode_pb2.KVData(layer_start=l0, layer_end=l1, block_start=b0, block_end=b1,
                                 data=bytes([l0 + 1]) * nbytes)

    structured = st.builds(build, st.integers(0, 3), st.integers(0, 3), near, near, st.data())
    return st.one_of(structured, messages(decode_pb2.KVData))


@FUZZ
@given(st.lists(_slabs(), max_size=8))
def test_kv_slabs_are_written_whole_or_refused(chunks: list[decode_pb2.KVData]) -> None:
    """A refused slab writes nothing; an accepted one lands in its cells only; the writer is
    complete exactly when every cell arrived once."""
    caches = [torch.zeros(SHAPE) for _ in range(LAYERS)]
    block_ids = [5, 0, 3, 1, 4, 2]  # shuffled, as a real block table is
    writer = KVSlabWriter(caches, block_ids)
    written: set[tuple[int, int]] = set()
    for chunk in chunks:
        slab: KVSlab = slab_from_pb(chunk)
        before = [c.clone() for c in caches]
        try:
            writer.write(slab)
        except ValueError:
            assert all(torch.equal(a, b) for a, b in zip(before, caches))
            continue
        cells = {(layer, b) for layer in range(slab.layer_start, slab.layer_end)
                 for b in range(slab.block_start, slab.block_end)}
        assert not cells & written
        written |= cells
    assert writer.complete == (len(written) == LAYERS * BLOCKS)
    assert writer.bytes_received == len(written) * CELL


@FUZZ
@given(messages(prefill_pb2.PrefillResponse))
def test_prompt_logprobs_never_fail_and_survive_the_wire(
    r: prefill_pb2.PrefillResponse,
) -> None:
    """Whatever a prefill worker answers, the gateway reads its prompt logprobs (one per
    position, top ids and logprobs paired), and sends on what it read unchanged."""
    got = prompt_logprobs_from_pb(r.prompt_logprobs)
    assert len(got) == len(r.prompt_logprobs)
    again = [prompt_logprob_to_pb(m.token_id, e) for m, e in zip(r.prompt_logprobs, got)]
    assert _plain(prompt_logprobs_from_pb(again)) == _plain(got)


def _plain(entries: list[Any]) -> list[Any]:
    """Comparable with NaNs (as text) and whatever order the top alternatives come in."""
    return [(repr(lp), rank, sorted(map(repr, top.items()))) for lp, rank, top in entries]


@FUZZ
@given(messages(decode_pb2.KVCommit))
def test_first_logprobs_never_fail(commit: decode_pb2.KVCommit) -> None:
    lp = first_logprobs(commit)
    assert lp is None or repr(lp) == repr(logprobs_from_pb(commit.first_logprobs))  # NaN too


@pytest.fixture(scope="module")
def tokenizer_servicer(bundled_path: str) -> TokenizerServicer:
    return TokenizerServicer(TokenizerModel(bundled_path, "smol", max_model_len=1024))


TEMPLATES = st.one_of(
    st.none(),
    st.sampled_from([
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
        "{% if %}", "{{ messages[0]['nothing'].x }}", "{{ raise_exception('no') }}",
        "{% for m in messages %}{{ m.content | upper }}{% endfor %}", "{{ 1 / 0 }}",
        "{{ messages.__class__.__mro__ }}",  # the sandbox refuses: a SecurityError
    ]),
    st.text(st.sampled_from("{}%#ab' \n|()[]"), max_size=30),
)


TOOLS_JSON = st.one_of(st.just(""), st.text(max_size=20), st.just(
    '[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]'))


@settings(FUZZ, max_examples=150)
@given(st.lists(messages(tokenizer_pb2.ChatMessage), max_size=4), st.booleans(), TEMPLATES,
       TOOLS_JSON)
def test_chat_template_rpc(
    tokenizer_servicer: TokenizerServicer, msgs: list[Any], add_prompt: bool, template: Any,
    tools_json: str,
) -> None:
    request = tokenizer_pb2.ChatTemplateRequest(messages=msgs, add_generation_prompt=add_prompt,
                                                tools_json=tools_json)
    if template is not None:
        request.chat_template = template
    try:  # tool calls that are not a JSON list are INVALID_ARGUMENT
        converted = messages_from_pb(request.messages)
        assert [(m["role"], m["content"]) for m in converted] == [
            (m.role, m.content) for m in msgs]
    except ValueError:
        assert any(m.tool_calls_json for m in msgs)
    try:
        reply = asyncio.run(tokenizer_servicer.ApplyChatTemplate(request, None))
    except ValueError:
        return
    assert all(0 <= t < tokenizer_servicer.model.vocab_size for t in reply.token_ids)


@settings(FUZZ, max_examples=150)
@given(messages(tokenizer_pb2.DetokenizeRequest), messages(tokenizer_pb2.TokenizeRequest))
def test_tokenize_and_detokenize_rpcs(
    tokenizer_servicer: TokenizerServicer, detok: Any, tok: Any
) -> None:
    reply = asyncio.run(tokenizer_servicer.Tokenize(tok, None))
    assert reply.prompt == tok.text
    try:
        asyncio.run(tokenizer_servicer.Detokenize(detok, None))
    except ValueError as exc:
        assert "outside the vocabulary" in str(exc)
