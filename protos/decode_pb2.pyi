from protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "prefill_locally", "prior_output_token_ids", "lora")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_LOCALLY_FIELD_NUMBER: _ClassVar[int]
    PRIOR_OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    prefill_locally: bool
    prior_output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    lora: _common_pb2.LoRAAdapter
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., prefill_locally: _Optional[bool] = ..., prior_output_token_ids: _Optional[_Iterable[int]] = ..., lora: _Optional[_Union[_common_pb2.LoRAAdapter, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "stop_token_id", "num_cached_tokens", "cached_blocks", "kv_target")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_TARGET_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    finish_reason: str
    stop_token_id: int
    num_cached_tokens: int
    cached_blocks: int
    kv_target: _common_pb2.KVTargetGrant
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., kv_target: _Optional[_Union[_common_pb2.KVTargetGrant, _Mapping]] = ...) -> None: ...

class GenerateStreamsRequest(_message.Message):
    __slots__ = ("opens", "cancels")
    OPENS_FIELD_NUMBER: _ClassVar[int]
    CANCELS_FIELD_NUMBER: _ClassVar[int]
    opens: _containers.RepeatedCompositeFieldContainer[GenerateRequest]
    cancels: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, opens: _Optional[_Iterable[_Union[GenerateRequest, _Mapping]]] = ..., cancels: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateStreamEvent(_message.Message):
    __slots__ = ("request_id", "response", "end_code", "end_message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    END_CODE_FIELD_NUMBER: _ClassVar[int]
    END_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    response: GenerateResponse
    end_code: int
    end_message: str
    def __init__(self, request_id: _Optional[str] = ..., response: _Optional[_Union[GenerateResponse, _Mapping]] = ..., end_code: _Optional[int] = ..., end_message: _Optional[str] = ...) -> None: ...

class GenerateStreamsReply(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[GenerateStreamEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[GenerateStreamEvent, _Mapping]]] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "dtype", "block_size")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ...) -> None: ...

class KVHeader(_message.Message):
    __slots__ = ("request_id", "layout", "num_tokens", "num_blocks", "transport", "push_id", "skip_blocks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    PUSH_ID_FIELD_NUMBER: _ClassVar[int]
    SKIP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    layout: KVLayout
    num_tokens: int
    num_blocks: int
    transport: str
    push_id: int
    skip_blocks: int
    def __init__(self, request_id: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., num_tokens: _Optional[int] = ..., num_blocks: _Optional[int] = ..., transport: _Optional[str] = ..., push_id: _Optional[int] = ..., skip_blocks: _Optional[int] = ...) -> None: ...

class KVCommit(_message.Message):
    __slots__ = ("first_token_id", "first_logprobs", "written")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_logprobs: _common_pb2.TokenLogprobs
    written: KVWritten
    def __init__(self, first_token_id: _Optional[int] = ..., first_logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., written: _Optional[_Union[KVWritten, _Mapping]] = ...) -> None: ...

class KVData(_message.Message):
    __slots__ = ("layer_start", "layer_end", "block_start", "block_end", "data")
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    BLOCK_START_FIELD_NUMBER: _ClassVar[int]
    BLOCK_END_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    layer_start: int
    layer_end: int
    block_start: int
    block_end: int
    data: bytes
    def __init__(self, layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., block_start: _Optional[int] = ..., block_end: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class KVWritten(_message.Message):
    __slots__ = ("layer_start", "layer_end", "block_start", "block_end")
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    BLOCK_START_FIELD_NUMBER: _ClassVar[int]
    BLOCK_END_FIELD_NUMBER: _ClassVar[int]
    layer_start: int
    layer_end: int
    block_start: int
    block_end: int
    def __init__(self, layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., block_start: _Optional[int] = ..., block_end: _Optional[int] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("header", "data", "commit", "written")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    header: KVHeader
    data: KVData
    commit: KVCommit
    written: KVWritten
    def __init__(self, header: _Optional[_Union[KVHeader, _Mapping]] = ..., data: _Optional[_Union[KVData, _Mapping]] = ..., commit: _Optional[_Union[KVCommit, _Mapping]] = ..., written: _Optional[_Union[KVWritten, _Mapping]] = ...) -> None: ...

class DescribeKVRequest(_message.Message):
    __slots__ = ("transports",)
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    transports: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, transports: _Optional[_Iterable[str]] = ...) -> None: ...

class KVPoolInfo(_message.Message):
    __slots__ = ("pool_id", "host_id", "layout", "num_blocks", "device_type", "device_uuid", "transports", "cuda_ipc_handle", "nixl_metadata", "nixl_pool_address", "nixl_device_id", "doorbell", "push_streams")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    NIXL_METADATA_FIELD_NUMBER: _ClassVar[int]
    NIXL_POOL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NIXL_DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    DOORBELL_FIELD_NUMBER: _ClassVar[int]
    PUSH_STREAMS_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    host_id: str
    layout: KVLayout
    num_blocks: int
    device_type: str
    device_uuid: str
    transports: _containers.RepeatedScalarFieldContainer[str]
    cuda_ipc_handle: bytes
    nixl_metadata: bytes
    nixl_pool_address: int
    nixl_device_id: int
    doorbell: str
    push_streams: bool
    def __init__(self, pool_id: _Optional[str] = ..., host_id: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., num_blocks: _Optional[int] = ..., device_type: _Optional[str] = ..., device_uuid: _Optional[str] = ..., transports: _Optional[_Iterable[str]] = ..., cuda_ipc_handle: _Optional[bytes] = ..., nixl_metadata: _Optional[bytes] = ..., nixl_pool_address: _Optional[int] = ..., nixl_device_id: _Optional[int] = ..., doorbell: _Optional[str] = ..., push_streams: _Optional[bool] = ...) -> None: ...

class KVTargetRequest(_message.Message):
    __slots__ = ("request_id", "pool_id", "transport")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    pool_id: str
    transport: str
    def __init__(self, request_id: _Optional[str] = ..., pool_id: _Optional[str] = ..., transport: _Optional[str] = ...) -> None: ...

class KVTargetReply(_message.Message):
    __slots__ = ("block_ids", "push_id")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    PUSH_ID_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    push_id: int
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., push_id: _Optional[int] = ...) -> None: ...

class PushKVResponse(_message.Message):
    __slots__ = ("bytes_received",)
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    bytes_received: int
    def __init__(self, bytes_received: _Optional[int] = ...) -> None: ...

class KVStreamChunk(_message.Message):
    __slots__ = ("request_id", "push_id", "chunk", "cut")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PUSH_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    CUT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    push_id: int
    chunk: KVChunk
    cut: bool
    def __init__(self, request_id: _Optional[str] = ..., push_id: _Optional[int] = ..., chunk: _Optional[_Union[KVChunk, _Mapping]] = ..., cut: _Optional[bool] = ...) -> None: ...

class KVStreamsRequest(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[KVStreamChunk]
    def __init__(self, chunks: _Optional[_Iterable[_Union[KVStreamChunk, _Mapping]]] = ...) -> None: ...

class KVPushOutcome(_message.Message):
    __slots__ = ("request_id", "push_id", "code", "message", "bytes_received")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PUSH_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    push_id: int
    code: int
    message: str
    bytes_received: int
    def __init__(self, request_id: _Optional[str] = ..., push_id: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., bytes_received: _Optional[int] = ...) -> None: ...

class KVStreamsReply(_message.Message):
    __slots__ = ("outcomes",)
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedCompositeFieldContainer[KVPushOutcome]
    def __init__(self, outcomes: _Optional[_Iterable[_Union[KVPushOutcome, _Mapping]]] = ...) -> None: ...
