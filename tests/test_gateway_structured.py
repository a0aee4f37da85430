"""Structured outputs at the gateway: every request form (OpenAI's `response_format`, vLLM's
`structured_outputs` and `guided_*`) becomes the one constraint a worker reads off the wire, a
conflict or a wrong type is a 400 naming the field, and the engine refusing the constraint (it
does not compile) is a 400 naming the field it came from, streamed or not, colocated or not.
In-process (ASGI) over the fake backend: what the worker would read is recorded there."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import grpc
import openai
import pytest
from fake_backend import FakeBackend
from fastapi.testclient import TestClient

from engine.sampling_params import SamplingParams
from engine.structured.params import StructuredOutputsParams
from gateway.app import build_app
from gateway.backend import RequestRejected, TokenDelta
from gateway.local_backend import LocalBackend
from gateway.protocol import ChatCompletionRequest
from gateway.recorder import StreamRecord
from gateway.remote_backend import RemoteBackend
from pdserve.cluster.registry import WorkerInfo

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
PATHS = (CMPL, CHAT)
SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}},
          "required": ["b", "a"]}
GRAMMAR = 'root ::= "yes" | "no"'
COMPILER = "Regex parsing error at position 2: The parenthesis is not closed."


@pytest.fixture(scope="module")
def backend(bundled_tokenizer: Any) -> FakeBackend:
    return FakeBackend(bundled_tokenizer, "fake", max_model_len=128)


@pytest.fixture(scope="module")
def http(backend: FakeBackend) -> Iterator[TestClient]:
    with TestClient(build_app(backend)) as client:
        yield client


def body(path: str, **kw: Any) -> dict[str, Any]:
    if path == CHAT:
        return {"model": "fake", "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 3, **kw}
    return {"model": "fake", "prompt": "Hello", "max_tokens": 3, **kw}


def json_schema(schema: Any = SCHEMA, **kw: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, **kw}}


def error_of(r: Any) -> dict[str, Any]:
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    return error


# request fields -> the constraint the worker reads (None: no constraint)
FORMS: dict[str, tuple[dict[str, Any], StructuredOutputsParams | None]] = {
    "no constraint": ({}, None),
    "response_format text": ({"response_format": {"type": "text"}}, None),
    "response_format json_object": ({"response_format": {"type": "json_object"}},
                                    StructuredOutputsParams(json_object=True)),
    "response_format json_schema": ({"response_format": json_schema()},
                                    StructuredOutputsParams(json=SCHEMA)),
    "response_format json_schema, strict and described": (
        {"response_format": json_schema(strict=True, description="a thing")},
        StructuredOutputsParams(json=SCHEMA)),
    "structured_outputs json": ({"structured_outputs": {"json": SCHEMA}},
                                StructuredOutputsParams(json=SCHEMA)),
    "structured_outputs json as text": ({"structured_outputs": {"json": json.dumps(SCHEMA)}},
                                        StructuredOutputsParams(json=SCHEMA)),
    "structured_outputs json_object": ({"structured_outputs": {"json_object": True}},
                                       StructuredOutputsParams(json_object=True)),
    "structured_outputs regex": ({"structured_outputs": {"regex": r"\d{3}"}},
                                 StructuredOutputsParams(regex=r"\d{3}")),
    "structured_outputs choice": ({"structured_outputs": {"choice": ["yes", "no"]}},
                                  StructuredOutputsParams(choice=["yes", "no"])),
    "structured_outputs grammar": ({"structured_outputs": {"grammar": GRAMMAR}},
                                   StructuredOutputsParams(grammar=GRAMMAR)),
    "structured_outputs with nulls": (
        {"structured_outputs": {"regex": "a+", "json": None, "json_object": False}},
        StructuredOutputsParams(regex="a+")),
    "guided_json": ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
    "guided_json as text": ({"guided_json": json.dumps(SCHEMA)},
                            StructuredOutputsParams(json=SCHEMA)),
    "guided_regex": ({"guided_regex": "[a-z]+"}, StructuredOutputsParams(regex="[a-z]+")),
    "guided_choice": ({"guided_choice": ["a", "b c"]},
                      StructuredOutputsParams(choice=["a", "b c"])),
    "guided_grammar": ({"guided_grammar": GRAMMAR}, StructuredOutputsParams(grammar=GRAMMAR)),
    "guided_decoding_backend xgrammar": (
        {"guided_regex": "x", "guided_decoding_backend": "xgrammar"},
        StructuredOutputsParams(regex="x")),
    "guided_decoding_backend auto": ({"guided_choice": ["x"], "guided_decoding_backend": "auto"},
                                     StructuredOutputsParams(choice=["x"])),
    "text format beside a guided field": (
        {"response_format": {"type": "text"}, "guided_regex": "x"},
        StructuredOutputsParams(regex="x")),
}


def wire(so: StructuredOutputsParams | None) -> tuple[str, str] | None:
    return None if so is None else (so.kind, so.spec())


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("form", list(FORMS))
def test_each_form_reaches_the_worker(
    http: TestClient, backend: FakeBackend, path: str, form: str
) -> None:
    fields, expected = FORMS[form]
    r = http.post(path, json=body(path, **fields))
    assert r.status_code == 200, r.text
    assert wire(backend.params[-1].structured_outputs) == wire(expected)


def test_the_openai_client_sends_each_form(http: TestClient, backend: FakeBackend) -> None:
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http,
                           max_retries=0)
    messages: Any = [{"role": "user", "content": "Hi"}]
    client.chat.completions.create(model="fake", messages=messages, max_tokens=2,
                                   response_format=json_schema(strict=True))  # type: ignore[arg-type]
    assert wire(backend.params[-1].structured_outputs) == wire(StructuredOutputsParams(
        json=SCHEMA))
    client.completions.create(model="fake", prompt="Hi", max_tokens=2,
                              extra_body={"structured_outputs": {"choice": ["a", "b"]}})
    assert wire(backend.params[-1].structured_outputs) == ("choice", '["a", "b"]')


def test_a_schema_keeps_its_key_order_to_the_worker(
    http: TestClient, backend: FakeBackend
) -> None:
    """xgrammar generates an object's properties in the schema's order (OpenAI's too): the
    schema must reach the worker with its keys in the client's order."""
    assert http.post(CHAT, json=body(CHAT, response_format=json_schema())).status_code == 200
    got = backend.params[-1].structured_outputs
    assert got is not None and list(json.loads(got.spec())) == list(SCHEMA)


@pytest.mark.parametrize("stream", [False, True])
def test_every_sequence_carries_the_constraint(
    http: TestClient, backend: FakeBackend, stream: bool
) -> None:
    before = len(backend.params)
    r = http.post(CMPL, json=body(CMPL, prompt=["a", "b"], n=2, stream=stream,
                                  guided_choice=["yes", "no"]))
    assert r.status_code == 200, r.text
    sent = backend.params[before:]
    assert len(sent) == 4
    assert {wire(p.structured_outputs) for p in sent} == {("choice", '["yes", "no"]')}


# (path, fields) -> param; every case on both routes unless it names one
BAD: dict[str, tuple[dict[str, Any], str]] = {
    "two forms": ({"response_format": {"type": "json_object"}, "guided_regex": "a"},
                  "response_format"),
    "two guided fields": ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex"),
    "structured_outputs and guided_json": ({"structured_outputs": {"regex": "a"},
                                            "guided_json": SCHEMA}, "structured_outputs"),
    "two kinds in structured_outputs": ({"structured_outputs": {"regex": "a", "choice": ["a"]}},
                                        "structured_outputs"),
    "empty structured_outputs": ({"structured_outputs": {}}, "structured_outputs"),
    "structured_outputs json_object false alone": (
        {"structured_outputs": {"json_object": False}}, "structured_outputs"),
    "unsupported structured_outputs option": (
        {"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs"),
    "structured_outputs not an object": ({"structured_outputs": "regex"}, "structured_outputs"),
    "other backend": ({"guided_regex": "a", "guided_decoding_backend": "outlines"},
                      "guided_decoding_backend"),
    "other backend without a constraint": ({"guided_decoding_backend": "lm-format-enforcer"},
                                           "guided_decoding_backend"),
    "response_format of another type": ({"response_format": {"type": "structural_tag"}},
                                        "response_format"),
    "response_format not an object": ({"response_format": "json"}, "response_format"),
    "json_schema type without json_schema": ({"response_format": {"type": "json_schema"}},
                                             "response_format"),
    "json_schema without a name": ({"response_format": {
        "type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format"),
    "json_schema without a schema": ({"response_format": {
        "type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    "json_schema with an unknown key": ({"response_format": json_schema(format="x")},
                                        "response_format"),
    "guided_json a number": ({"guided_json": 5}, "guided_json"),
    "guided_json text that is not JSON": ({"guided_json": "{type: object"}, "guided_json"),
    "guided_json text that is not an object": ({"guided_json": "[1, 2]"}, "guided_json"),
    "guided_json text with NaN": ({"guided_json": '{"maximum": NaN}'}, "guided_json"),
    "structured_outputs json text that is not an object": (
        {"structured_outputs": {"json": "true"}}, "structured_outputs"),
    "guided_regex empty": ({"guided_regex": ""}, "guided_regex"),
    "guided_regex a number": ({"guided_regex": 5}, "guided_regex"),
    "guided_choice empty": ({"guided_choice": []}, "guided_choice"),
    "guided_choice of numbers": ({"guided_choice": [1, 2]}, "guided_choice"),
    "guided_choice with an empty string": ({"guided_choice": ["a", ""]}, "guided_choice"),
    "guided_grammar a list": ({"guided_grammar": ["root ::= x"]}, "guided_grammar"),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", list(BAD))
def test_bad_constraints_are_400s_naming_the_field(
    http: TestClient, backend: FakeBackend, path: str, case: str
) -> None:
    fields, param = BAD[case]
    before = backend.generated
    r = http.post(path, json=body(path, **fields))
    assert r.status_code == 400, r.text
    assert error_of(r)["param"] == param
    assert backend.generated == before  # refused before anything was generated


def test_messages_name_what_is_wrong(http: TestClient) -> None:
    two = http.post(CHAT, json=body(CHAT, response_format={"type": "json_object"},
                                    guided_regex="a", guided_choice=["a"]))
    assert error_of(two)["message"] == ("Only one structured output constraint may be given; "
                                        "got response_format, guided_regex, guided_choice.")
    not_object = http.post(CHAT, json=body(CHAT, response_format=json_schema(schema=[1])))
    assert error_of(not_object)["message"].startswith("response_format.json_schema.schema: ")
    backend = http.post(CMPL, json=body(CMPL, guided_decoding_backend="outlines"))
    assert "'outlines' is not supported" in error_of(backend)["message"]


# ---- the engine refusing the constraint ------------------------------------------------
class RejectingBackend(FakeBackend):
    """A worker whose compiler refuses every constraint, as RemoteBackend reports it."""

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncGenerator[TokenDelta, None]:
        if params.structured_outputs is not None:
            raise RequestRejected(COMPILER)
        async for delta in super().generate(request_id, prompt_token_ids, params):
            yield delta


@pytest.fixture(scope="module")
def rejecting(bundled_tokenizer: Any) -> Iterator[TestClient]:
    with TestClient(build_app(RejectingBackend(bundled_tokenizer))) as client:
        yield client


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("path", "fields", "param"), [
    (CHAT, {"response_format": json_schema()}, "response_format"),
    (CMPL, {"guided_regex": "(a"}, "guided_regex"),
    (CHAT, {"structured_outputs": {"grammar": GRAMMAR}}, "structured_outputs"),
])
def test_a_constraint_the_engine_refuses_is_a_400_naming_its_field(
    rejecting: TestClient, path: str, fields: dict[str, Any], param: str, stream: bool
) -> None:
    r = rejecting.post(path, json=body(path, stream=stream, n=2, **fields))
    assert r.status_code == 400, r.text
    error = error_of(r)
    assert (error["message"], error["param"]) == (COMPILER, param)
    ok = rejecting.post(path, json=body(path, stream=stream))  # and it keeps serving
    assert ok.status_code == 200


def test_a_worker_invalid_argument_is_a_rejection() -> None:
    """The engine's ValueError reaches the gateway as INVALID_ARGUMENT (the shared interceptor;
    tests/test_fuzz_converters.py): RemoteBackend makes it RequestRejected, without the
    worker's address in the message the client will read."""
    backend = RemoteBackend.__new__(RemoteBackend)  # _error needs no connection for this
    worker = WorkerInfo("w1", "prefill", "10.0.0.1:50051")
    for code, rejected in ((grpc.StatusCode.INVALID_ARGUMENT, True),
                           (grpc.StatusCode.INTERNAL, False)):
        exc = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), COMPILER)
        error = asyncio.run(backend._error(exc, worker))
        assert isinstance(error, RequestRejected) == rejected and not error.retryable
        assert (str(error) == COMPILER) == rejected


class _RefusingEngine:
    """An AsyncLLMEngine whose add_request refuses the request (ValueError)."""

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncGenerator[Any, None]:
        raise ValueError(COMPILER)
        yield


def test_an_engine_value_error_is_a_rejection_when_colocated() -> None:
    backend = LocalBackend(_RefusingEngine(), "tiny")  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(regex="("))

    async def first() -> Any:
        return await anext(backend.generate("r1", [1, 2], params))

    with pytest.raises(RequestRejected, match="parenthesis is not closed"):
        asyncio.run(first())


# ---- resumable streams -----------------------------------------------------------------
@pytest.mark.parametrize("so", [
    None, StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(json_object=True),
    StructuredOutputsParams(regex="a+"), StructuredOutputsParams(choice=["x", "y"]),
    StructuredOutputsParams(grammar=GRAMMAR),
], ids=str)
def test_a_recorded_stream_resumes_under_the_same_constraint(
    so: StructuredOutputsParams | None,
) -> None:
    params = SamplingParams(n=2, max_tokens=5, structured_outputs=so)
    record = StreamRecord.of("chat", "chatcmpl-1", "m", 1, {}, [[1, 2]], [None], [params])
    (again,) = StreamRecord.from_json(record.to_json()).sampling_params()
    assert wire(again.structured_outputs) == wire(so)
    assert (again.n, again.max_tokens) == (2, 5)


def test_a_record_of_an_older_gateway_has_no_constraint() -> None:
    params = SamplingParams(max_tokens=5)
    record = StreamRecord.of("chat", "chatcmpl-1", "m", 1, {}, [[1, 2]], [None], [params])
    del record.params[0]["structured_outputs"]
    (again,) = StreamRecord.from_json(record.to_json()).sampling_params()
    assert again.structured_outputs is None


def test_a_recorded_request_body_validates_again(http: TestClient) -> None:
    """The stream record keeps the request as `model_dump(mode="json")`; a resume validates
    it again (restore_view), aliases (`schema`, `json`) included."""
    req = ChatCompletionRequest.model_validate(body(
        CHAT, response_format=json_schema(strict=True), structured_outputs=None))
    dumped = req.model_dump(mode="json")
    assert dumped["response_format"]["json_schema"]["schema"] == SCHEMA
    assert ChatCompletionRequest.model_validate(dumped) == req
    so = ChatCompletionRequest.model_validate(body(CHAT, structured_outputs={"json": SCHEMA}))
    assert so.model_dump(mode="json")["structured_outputs"]["json"] == SCHEMA


def test_the_offline_api_exports_the_params() -> None:
    from pdserve import StructuredOutputsParams as Exported

    assert Exported is StructuredOutputsParams
