from protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "decode_address", "prior_output_token_ids", "decode_cached_blocks", "lora", "decode_kv_target", "decode_reservation_pending")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PRIOR_OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    DECODE_KV_TARGET_FIELD_NUMBER: _ClassVar[int]
    DECODE_RESERVATION_PENDING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    decode_address: str
    prior_output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    decode_cached_blocks: int
    lora: _common_pb2.LoRAAdapter
    decode_kv_target: _common_pb2.KVTargetGrant
    decode_reservation_pending: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., decode_address: _Optional[str] = ..., prior_output_token_ids: _Optional[_Iterable[int]] = ..., decode_cached_blocks: _Optional[int] = ..., lora: _Optional[_Union[_common_pb2.LoRAAdapter, _Mapping]] = ..., decode_kv_target: _Optional[_Union[_common_pb2.KVTargetGrant, _Mapping]] = ..., decode_reservation_pending: _Optional[bool] = ...) -> None: ...

class ReservedRequest(_message.Message):
    __slots__ = ("request_id", "decode_cached_blocks", "decode_kv_target")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DECODE_KV_TARGET_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    decode_cached_blocks: int
    decode_kv_target: _common_pb2.KVTargetGrant
    def __init__(self, request_id: _Optional[str] = ..., decode_cached_blocks: _Optional[int] = ..., decode_kv_target: _Optional[_Union[_common_pb2.KVTargetGrant, _Mapping]] = ...) -> None: ...

class ReservedResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class PrefillStreamsRequest(_message.Message):
    __slots__ = ("prefills", "reserveds", "cancels")
    PREFILLS_FIELD_NUMBER: _ClassVar[int]
    RESERVEDS_FIELD_NUMBER: _ClassVar[int]
    CANCELS_FIELD_NUMBER: _ClassVar[int]
    prefills: _containers.RepeatedCompositeFieldContainer[PrefillRequest]
    reserveds: _containers.RepeatedCompositeFieldContainer[ReservedRequest]
    cancels: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, prefills: _Optional[_Iterable[_Union[PrefillRequest, _Mapping]]] = ..., reserveds: _Optional[_Iterable[_Union[ReservedRequest, _Mapping]]] = ..., cancels: _Optional[_Iterable[str]] = ...) -> None: ...

class PrefillStreamAnswer(_message.Message):
    __slots__ = ("request_id", "reserved_call", "prefill", "reserved", "error_code", "error_message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVED_CALL_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reserved_call: bool
    prefill: PrefillResponse
    reserved: ReservedResponse
    error_code: int
    error_message: str
    def __init__(self, request_id: _Optional[str] = ..., reserved_call: _Optional[bool] = ..., prefill: _Optional[_Union[PrefillResponse, _Mapping]] = ..., reserved: _Optional[_Union[ReservedResponse, _Mapping]] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ...) -> None: ...

class PrefillStreamsReply(_message.Message):
    __slots__ = ("answers",)
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    answers: _containers.RepeatedCompositeFieldContainer[PrefillStreamAnswer]
    def __init__(self, answers: _Optional[_Iterable[_Union[PrefillStreamAnswer, _Mapping]]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "first_logprobs", "num_cached_tokens", "finish_reason", "prompt_logprobs")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_logprobs: _common_pb2.TokenLogprobs
    num_cached_tokens: int
    finish_reason: str
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptTokenLogprob]
    def __init__(self, first_token_id: _Optional[int] = ..., first_logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., finish_reason: _Optional[str] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptTokenLogprob, _Mapping]]] = ...) -> None: ...

class PromptTokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "rank", "top_token_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...
