"""Limits checked on a large ModelInferRequest's bytes, before protobuf builds its repeated fields.

protobuf parses a whole message before any handler runs, and builds an object for every entry of a
repeated field or map: 2 million empty parameters in 27 MiB cost about half a second of parsing on the
event loop, during which nothing else is answered, before the data plane could count them. So a large
message with many top-level fields is first read as `Counts`, a message with the same field numbers
declared as plain bytes (protobuf records where each entry is, and builds nothing in it), and its counts
are checked against the server's limits; only a message within them is parsed for real.

A message of a few fields (the usual large one: a big tensor in one raw_input_contents entry) is told
apart by a scan of its top-level field headers, and goes straight to the real parse; so does one whose
many fields are all raw_input_contents, which are plain bytes to the real parse as well (reading them
twice would cost more than it saves).
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError, Message

from service.serving.dataplane import MAX_PARAMETERS

__all__ = ["FEW_FIELDS", "MAX_TENSORS", "SCREEN_BYTES", "few_fields", "screen_infer"]

SCREEN_BYTES = 1 << 16  # a smaller message holds too few entries to cost anything
FEW_FIELDS = 256  # a message with no more top-level fields than this is parsed at once
MAX_TENSORS = 4096  # inputs (or outputs) one request may name, whatever the model (refused here, not counted)

# The repeated fields whose entries protobuf builds objects of (a map, and messages); raw_input_contents
# (7) is left out: an unknown field to `Counts`, kept as bytes.
_REPEATED = (("parameters", 4), ("inputs", 5), ("outputs", 6))


def _counts_class() -> type[Message]:
    file = descriptor_pb2.FileDescriptorProto(name="qkv_wire_limits.proto", package="qkv.wire", syntax="proto3")
    message = file.message_type.add(name="Counts")
    for name, number in _REPEATED:
        message.field.add(
            name=name,
            number=number,
            type=descriptor_pb2.FieldDescriptorProto.TYPE_BYTES,
            label=descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED,
        )
    pool = descriptor_pool.DescriptorPool()  # its own: nothing of it reaches protobuf's default pool
    pool.Add(file)
    counts: type[Message] = message_factory.GetMessageClass(pool.FindMessageTypeByName("qkv.wire.Counts"))
    return counts


Counts = _counts_class()


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def few_fields(data: bytes, limit: int = FEW_FIELDS) -> bool:
    """Whether `data` holds at most `limit` top-level fields (read from their headers alone; a message
    that does not scan is left to the real parse, which says what is wrong)."""
    return _scan(data, limit)[0]


def _scan(data: bytes, limit: int) -> tuple[bool, set[int]]:
    """(at most `limit` top-level fields, the field numbers among the first `limit`)."""
    pos, count, numbers = 0, 0, set[int]()
    try:
        while pos < len(data):
            if count == limit:
                return False, numbers
            tag, pos = _varint(data, pos)
            numbers.add(tag >> 3)
            wire = tag & 7
            if wire == 0:
                _, pos = _varint(data, pos)
            elif wire == 1:
                pos += 8
            elif wire == 2:
                length, pos = _varint(data, pos)
                pos += length
            elif wire == 5:
                pos += 4
            else:
                return True, numbers
            count += 1
    except ValueError:
        return True, numbers
    return True, numbers


def screen_infer(data: bytes) -> str | None:
    """Why a ModelInferRequest's bytes are refused before they are parsed (a count over its limit), or None."""
    if len(data) <= SCREEN_BYTES:
        return None
    few, numbers = _scan(data, FEW_FIELDS)
    if few or not numbers & {number for _, number in _REPEATED}:
        return None
    try:
        counts: Any = Counts.FromString(data)
    except DecodeError:
        return None  # the real parse refuses it, saying why
    parameters, inputs, outputs = len(counts.parameters), len(counts.inputs), len(counts.outputs)
    if parameters > MAX_PARAMETERS:
        return f"{parameters} parameters, the limit is {MAX_PARAMETERS}"
    if inputs > MAX_TENSORS:
        return f"{inputs} inputs, the limit is {MAX_TENSORS}"
    if outputs > MAX_TENSORS:
        return f"{outputs} outputs requested, the limit is {MAX_TENSORS}"
    return None
