"""Hypothesis strategies for any protobuf message, read off its descriptor: every field present
or not, each value anywhere in its wire type's range (NaN and inf floats, ids up to 2**32 - 1,
any text, any bytes; maps as dicts), small values drawn often so that some messages are also
valid. A message whose valid values random text would almost never hit (a StructuredOutput's
kind and spec) or whose fields belong together (a PromptTokenLogprob's paired top ids and
logprobs) is drawn valid half the time (`_VALID`)."""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

from engine.structured.params import StructuredOutputsParams

_T = FieldDescriptor
_TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)  # proto strings: UTF-8


def _ints(low: int, high: int) -> st.SearchStrategy[int]:
    small = st.integers(max(low, -4), min(high, 64))
    return st.one_of(small, st.integers(low, high))


_SCALARS: dict[int, st.SearchStrategy[Any]] = {
    _T.TYPE_FLOAT: st.floats(width=32),
    _T.TYPE_DOUBLE: st.floats(),
    _T.TYPE_BOOL: st.booleans(),
    _T.TYPE_STRING: _TEXT,
    _T.TYPE_BYTES: st.binary(max_size=512),
    _T.TYPE_INT32: _ints(-(2**31), 2**31 - 1),
    _T.TYPE_SINT32: _ints(-(2**31), 2**31 - 1),
    _T.TYPE_SFIXED32: _ints(-(2**31), 2**31 - 1),
    _T.TYPE_UINT32: _ints(0, 2**32 - 1),
    _T.TYPE_FIXED32: _ints(0, 2**32 - 1),
    _T.TYPE_INT64: _ints(-(2**63), 2**63 - 1),
    _T.TYPE_SINT64: _ints(-(2**63), 2**63 - 1),
    _T.TYPE_SFIXED64: _ints(-(2**63), 2**63 - 1),
    _T.TYPE_UINT64: _ints(0, 2**64 - 1),
    _T.TYPE_FIXED64: _ints(0, 2**64 - 1),
}


def structured_outputs() -> st.SearchStrategy[StructuredOutputsParams]:
    """Valid constraints of every kind (valid to `StructuredOutputsParams`; not all compile)."""
    text = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=20)
    leaf = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False,
                                                                 allow_infinity=False) | text
    value = st.recursive(leaf, lambda kids: st.lists(kids, max_size=3)
                         | st.dictionaries(text, kids, max_size=3), max_leaves=8)
    return st.one_of(
        st.dictionaries(text, value, max_size=4).map(lambda d: StructuredOutputsParams(json=d)),
        text.map(lambda t: StructuredOutputsParams(json=t)),
        st.just(StructuredOutputsParams(json_object=True)),
        text.map(lambda t: StructuredOutputsParams(regex=t)),
        st.lists(text, min_size=1, max_size=5).map(lambda c: StructuredOutputsParams(choice=c)),
        text.map(lambda t: StructuredOutputsParams(grammar=t)),
    )


def _structured_output_msgs(cls: type[Message]) -> st.SearchStrategy[Message]:
    return structured_outputs().map(lambda so: cls(kind=so.kind, spec=so.spec()))


def _prompt_logprob_msgs(cls: type[Message]) -> st.SearchStrategy[Message]:
    """A prompt position as a prefill worker sends it: top ids and logprobs paired."""
    top = st.lists(st.tuples(_SCALARS[_T.TYPE_UINT32], st.floats(width=32, max_value=0)),
                   max_size=5)
    return st.builds(
        lambda token_id, logprob, rank, pairs: cls(
            token_id=token_id, logprob=logprob, rank=rank,
            top_token_ids=[t for t, _ in pairs], top_logprobs=[v for _, v in pairs]),
        _SCALARS[_T.TYPE_UINT32], st.floats(width=32, max_value=0), _ints(1, 2**32 - 1), top,
    )


_VALID = {"pdserve.v1.StructuredOutput": _structured_output_msgs,
          "pdserve.v1.PromptTokenLogprob": _prompt_logprob_msgs}


def messages(cls: type[Message], depth: int = 3) -> st.SearchStrategy[Message]:
    """Random instances of `cls` (nested messages down to `depth` levels)."""
    fields = {f.name: _field(f, depth) for f in cls.DESCRIPTOR.fields}
    return st.fixed_dictionaries({}, optional=fields).map(lambda kw: cls(**kw))


def _field(f: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    entry = f.message_type if f.type == _T.TYPE_MESSAGE else None
    if entry is not None and entry.GetOptions().map_entry:  # map<K, V>: a dict
        key, value = (_value(entry.fields_by_name[n], depth) for n in ("key", "value"))
        return st.dictionaries(key, value, max_size=6)
    value = _value(f, depth)
    return st.lists(value, max_size=6) if _is_repeated(f) else value


def _value(f: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if f.type == _T.TYPE_MESSAGE:
        cls = _message_class(f.message_type)
        if depth <= 0:
            return st.just(cls())
        valid = _VALID.get(f.message_type.full_name)
        return messages(cls, depth - 1) | (st.nothing() if valid is None else valid(cls))
    if f.type == _T.TYPE_ENUM:
        return st.sampled_from([v.number for v in f.enum_type.values])
    return _SCALARS[f.type]


def _is_repeated(f: FieldDescriptor) -> bool:
    repeated = getattr(f, "is_repeated", None)  # newer protobuf; `label` is deprecated there
    return bool(repeated) if repeated is not None else f.label == _T.LABEL_REPEATED


def _message_class(descriptor: Descriptor) -> type[Message]:
    return GetMessageClass(descriptor)
