"""A large ModelInferRequest's repeated fields counted on the wire, before protobuf parses it.

Parsing builds an object for every entry of a map or a repeated field, at some 30-50 ns each while
holding the GIL: 20 M empty outputs or 2 M parameters fit in 64 MiB and cost a second or more before
the server's code could count them. So a message over WALKED_BYTES is first walked, tag by tag, and
each repeated field is counted only up to its limit: the walk stops at the first field over its limit,
so it costs at most some MAX_WIRE_FIELDS steps whatever the message holds (a legal 16 MiB tensor is a
handful of steps, its bytes skipped by their length). Only then is the message parsed. A small message
is parsed directly: it cannot hold enough entries to be slow.

The limits of the walk are server-wide (the model a request names is not known yet); the data plane
checks a request against its model's counts afterwards, as for a small message.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from google.protobuf.message import DecodeError

from service import protocol
from service.datatypes import MAX_BYTES_ELEMENTS
from service.serving.dataplane import MAX_ID_CHARS, MAX_PARAMETERS

__all__ = ["MAX_TENSORS", "MAX_WIRE_FIELDS", "WALKED_BYTES", "Refused", "infer_request_deserializer"]

WALKED_BYTES = 64 << 10  # a message larger than this is walked before it is parsed
MAX_TENSORS = 1024  # inputs, outputs and raw_input_contents of one large request, each at most
MAX_OTHER_FIELDS = 64  # fields of one message besides its counted ones (names, shape, unknown fields)
MAX_WIRE_FIELDS = 4 * MAX_BYTES_ELEMENTS  # fields of one large request, all levels together


@dataclass(frozen=True)
class _Counted:
    """A repeated field (or map) of a message: its name in a refusal, its limit and the limit's name."""

    name: str
    limit: int
    limit_name: str


@dataclass(frozen=True)
class _Layout:
    """What the walk counts in one message type: field number -> its limit; the fields it walks into
    (number -> their name and layout); and how many other fields (names, shape, unknown ones) it takes."""

    counted: dict[int, _Counted]
    inner: dict[int, tuple[str, _Layout]] = field(default_factory=dict)
    others: int = MAX_OTHER_FIELDS


_PARAMETERS = _Counted("parameters", MAX_PARAMETERS, "MAX_PARAMETERS")
_CONTENTS = _Layout(
    {8: _Counted("bytes_contents", MAX_BYTES_ELEMENTS, "MAX_BYTES_ELEMENTS")},
    # numeric contents are packed (one field each) by every proto3 client; unpacked, at most this many
    others=MAX_BYTES_ELEMENTS,
)
_INPUT = _Layout({4: _PARAMETERS}, inner={5: ("contents", _CONTENTS)})
_OUTPUT = _Layout({2: _PARAMETERS})
_REQUEST = _Layout(
    {
        4: _PARAMETERS,
        5: _Counted("inputs", MAX_TENSORS, "MAX_TENSORS"),
        6: _Counted("outputs", MAX_TENSORS, "MAX_TENSORS"),
        7: _Counted("raw_input_contents", MAX_TENSORS, "MAX_TENSORS"),
    },
    inner={5: ("inputs", _INPUT), 6: ("outputs", _OUTPUT)},
)
_MODEL_NAME, _ID = 1, 3  # ModelInferRequest's fields that a streamed refusal echoes


class Refused(protocol.Undecodable):
    """A large request refused on the wire, in its parsed message's place: a unary RPC answers it
    INVALID_ARGUMENT, ModelStreamInfer as that request's error_message (the stream goes on).
    `model_name` and `id` are read from the wire, for the stream's answer to name the request."""

    def __init__(self, reason: str, model_name: str = "", id: str = "") -> None:
        self.reason, self.model_name, self.id = reason, model_name, id


class _Malformed(Exception):
    """The walk cannot follow the message (a truncated field, a length past its end): the parse says why."""


def _varint(data: bytes, i: int, end: int) -> tuple[int, int]:
    """The varint at data[i:], and the offset after it."""
    value = shift = 0
    while i < end and shift < 64:
        byte = data[i]
        value |= (byte & 0x7F) << shift
        i += 1
        if byte < 0x80:
            return value, i
        shift += 7
    raise _Malformed


class _Walk:
    """One message's walk: the fields it visited so far (all levels), and the request's name and id."""

    def __init__(self, data: bytes) -> None:
        self.data, self.fields = data, 0
        self.model_name = self.id = b""

    def refuse(self, reason: str) -> Refused:
        name, id = (text[:MAX_ID_CHARS].decode(errors="replace") for text in (self.model_name, self.id))
        return Refused(reason, name, id)

    def over(self, what: str, limit: int, limit_name: str) -> Refused:
        return self.refuse(
            f"{what}: more than {limit} in a {len(self.data)}-byte request, the limit is {limit} ({limit_name})"
        )

    def message(self, layout: _Layout, start: int, end: int, path: str) -> Refused | None:
        """Count the fields of the message at data[start:end] (and of those it walks into) against `layout`;
        the first field over its limit is the refusal. `path`: the message's place in the request."""
        data, counts, others = self.data, dict.fromkeys(layout.counted, 0), 0
        i = start
        while i < end:
            self.fields += 1
            if self.fields > MAX_WIRE_FIELDS:
                return self.over("protobuf fields", MAX_WIRE_FIELDS, "MAX_WIRE_FIELDS")
            tag, i = _varint(data, i, end)
            number, wire_type = tag >> 3, tag & 7
            if wire_type == 2:  # length-delimited: a string, bytes, a message or a packed array
                length, i = _varint(data, i, end)
                if i + length > end:
                    raise _Malformed
                if number in layout.inner:
                    name, inner = layout.inner[number]
                    where = f"{path}{name}[{counts[number]}]." if number in counts else f"{path}{name}."
                    if (refused := self.message(inner, i, i + length, where)) is not None:
                        return refused
                elif layout is _REQUEST and number == _MODEL_NAME:
                    self.model_name = data[i : i + length]
                elif layout is _REQUEST and number == _ID:
                    self.id = data[i : i + length]
                i += length
            elif wire_type == 0:
                _, i = _varint(data, i, end)
            elif wire_type in (1, 5):
                i += 8 if wire_type == 1 else 4
            elif wire_type == 3:  # left to the parse, the fields after a group would go uncounted
                return self.refuse(f"{path}field {number}: a group, which no message of the protocol has")
            else:
                raise _Malformed
            if number in counts:
                counts[number] += 1
                counted = layout.counted[number]
                if counts[number] > counted.limit:
                    return self.over(f"{path}{counted.name}", counted.limit, counted.limit_name)
            else:
                others += 1
                if others > layout.others:
                    names = [c.name for c in layout.counted.values()] + [n for n, _ in layout.inner.values()]
                    fields = ", ".join(dict.fromkeys(names))
                    return self.over(f"{path}fields other than {fields}", layout.others, "MAX_OTHER_FIELDS")
        if i > end:
            raise _Malformed
        return None


def over_limit(data: bytes) -> Refused | None:
    """Why a ModelInferRequest's wire form is refused, or None. A message the walk cannot follow (a
    truncated field, a length past its end) is left to the parse, which says what is wrong with it: the
    fields before that point were within their limits."""
    try:
        return _Walk(data).message(_REQUEST, 0, len(data), "")
    except _Malformed:
        return None


_parse = protocol.ModelInferRequest.FromString


def infer_request_deserializer(data: bytes) -> protocol.ModelInferRequest | protocol.Undecodable:
    """gRPC's request_deserializer for ModelInfer and ModelStreamInfer: a large message walked first."""
    if len(data) > WALKED_BYTES and (refused := over_limit(data)) is not None:
        return refused
    try:
        return _parse(data)
    except DecodeError as e:
        return protocol.Undecodable("ModelInferRequest", e)
