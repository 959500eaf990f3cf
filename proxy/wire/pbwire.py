"""A walk over the top-level fields of a protobuf message, without copying.

Used to take the tensor payload fields (``raw_input_contents``, ``raw_output_contents``, typed
``contents``) out of a v2 message as memoryview slices while the small rest is parsed normally:
a 600 KB tensor is then never copied into a Python bytes object on its way through mmguard, and
a repeated field is counted (numpy over its bytes, or a walk with a budget) before any list of
its values exists.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
from numpy.typing import NDArray

VARINT, I64, LEN, I32 = 0, 1, 2, 5


class WireError(ValueError):
    pass


def _varint(view: memoryview | bytes, pos: int) -> tuple[int, int]:
    if pos < len(view) and view[pos] < 0x80:  # one byte: most tags and small lengths
        return view[pos], pos + 1
    result = shift = 0
    while True:
        if pos >= len(view):
            raise WireError(f"truncated varint at byte {pos}")
        byte = view[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise WireError(f"varint longer than 10 bytes at byte {pos}")


class FieldLimit(WireError):
    """A message holds more of something than mmguard takes (not broken framing)."""

    def __init__(self, limit: int, what: str) -> None:
        super().__init__(f"more than {limit} {what}")
        self.limit = limit
        self.what = what


class Budget:
    """How many more fields a walk may visit: each costs Python time, so a message of millions
    of tiny fields is refused once the budget is spent instead of being walked to its end."""

    def __init__(self, fields: int, what: str = "fields") -> None:
        self.limit = self.left = fields
        self.what = what

    def spend(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise FieldLimit(self.limit, self.what)


def fields(view: memoryview, budget: Budget | None = None
           ) -> Iterator[tuple[int, int, int, int]]:
    """(field number, start of the tag, start of the value, end) for each top-level field."""
    pos = 0
    while pos < len(view):
        if budget is not None:
            budget.spend()
        number, _, value, end = field_at(view, pos, len(view))
        yield number, pos, value, end
        pos = end


def field_at(data: memoryview | bytes, pos: int, limit: int) -> tuple[int, int, int, int]:
    """(field number, wire type, start of the value, end) of the field whose tag starts at
    ``pos``; it must end by ``limit``."""
    key, value = _varint(data, pos)
    number, wire_type = key >> 3, key & 7
    if number == 0:
        raise WireError(f"field number 0 at byte {pos}")
    if wire_type == VARINT:
        _, end = _varint(data, value)
    elif wire_type == LEN:
        length, value = _varint(data, value)
        end = value + length
    elif wire_type == I64:
        end = value + 8
    elif wire_type == I32:
        end = value + 4
    else:
        raise WireError(f"unsupported wire type {wire_type} for field {number}")
    if end > limit:
        raise WireError(f"field {number} runs past the end ({end} > {limit} bytes)")
    return number, wire_type, value, end


def wire_type_at(view: memoryview, start: int) -> int:
    """The wire type of the field whose tag starts at ``start``."""
    return int(view[start]) & 7


def count_varints(view: memoryview) -> int:
    """How many varints a packed field holds: one per byte without the continuation bit."""
    if len(view) <= _SMALL_PACKED:  # a shape: bytes' own C loop, numpy's set-up costs more
        if view and view[-1] & 0x80:
            raise WireError("a packed varint field ends inside a varint")
        return len(view) - len(bytes(view).translate(None, _CONTINUED))
    data = np.frombuffer(view, dtype=np.uint8)
    if data.size and data[-1] & 0x80:
        raise WireError("a packed varint field ends inside a varint")
    return int(np.count_nonzero(data < 0x80))


_SMALL_PACKED = 256
_CONTINUED = bytes(range(0x80))
"""``bytes.translate`` deletes these (the bytes that end a varint): what is left continues one."""


def decode_varints(view: memoryview | bytes) -> NDArray[np.uint64]:
    """All varints of a packed field, as uint64, decoded by numpy (no Python int per value)."""
    data = np.frombuffer(view, dtype=np.uint8)
    if not data.size:
        return np.zeros(0, dtype=np.uint64)
    ends = np.flatnonzero(data < 0x80)
    if not ends.size or ends[-1] != data.size - 1:
        raise WireError("a packed varint field ends inside a varint")
    if ends.size == data.size:  # every value below 128: one byte each
        return data.astype(np.uint64)
    starts = np.concatenate(([0], ends[:-1] + 1))
    lengths = ends - starts + 1
    if int(lengths.max()) > 10 or bool(np.any((lengths == 10) & (data[ends] > 1))):
        raise WireError("a varint does not fit 64 bits")
    # The shift of each byte is 7 × its place inside its own varint.
    place: NDArray[Any] = np.arange(data.size) - np.repeat(starts, lengths)
    groups = (data & 0x7F).astype(np.uint64) << (place * 7).astype(np.uint64)
    values: NDArray[np.uint64] = np.bitwise_or.reduceat(groups, starts)
    return values


def encode_varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def len_field(number: int, payload: bytes | memoryview) -> bytes:
    """A length-delimited field: tag, length, payload."""
    return encode_varint((number << 3) | LEN) + encode_varint(len(payload)) + bytes(payload)


def split(body: bytes, raw_field: int) -> tuple[bytes, list[memoryview]]:
    """The message without ``raw_field`` (to parse), and that field's values as slices."""
    view = memoryview(body)
    rest: list[memoryview] = []
    raws: list[memoryview] = []
    for number, start, value, end in fields(view):
        if number == raw_field:
            raws.append(view[value:end])
        else:
            rest.append(view[start:end])
    return b"".join(rest), raws
