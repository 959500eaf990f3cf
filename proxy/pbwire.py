"""A walk over the top-level fields of a protobuf message, without copying.

Used to take the tensor payload fields (``raw_input_contents``, ``raw_output_contents``) out of
a v2 message as memoryview slices while the small rest is parsed normally: a 600 KB tensor is
then never copied into a Python bytes object on its way through mmguard.
"""

from __future__ import annotations

from collections.abc import Iterator

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


class WireError(ValueError):
    pass


def _varint(view: memoryview, pos: int) -> tuple[int, int]:
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


def fields(view: memoryview) -> Iterator[tuple[int, int, int, int]]:
    """(field number, start of the tag, start of the value, end) for each top-level field."""
    pos = 0
    while pos < len(view):
        start = pos
        key, pos = _varint(view, pos)
        number, wire_type = key >> 3, key & 7
        if number == 0:
            raise WireError(f"field number 0 at byte {start}")
        if wire_type == _VARINT:
            _, end = _varint(view, pos)
        elif wire_type == _LEN:
            length, pos = _varint(view, pos)
            end = pos + length
        elif wire_type == _I64:
            end = pos + 8
        elif wire_type == _I32:
            end = pos + 4
        else:
            raise WireError(f"unsupported wire type {wire_type} for field {number}")
        if end > len(view):
            raise WireError(f"field {number} runs past the end ({end} > {len(view)} bytes)")
        yield number, start, pos, end
        pos = end


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
