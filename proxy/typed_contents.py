"""gRPC typed ``InferTensorContents`` → raw little-endian bytes, counted before converted.

tritonclient always sends ``raw_input_contents``; typed contents (``int64_contents``,
``bytes_contents``, …) are rare, but a 7 MiB ``int64_contents`` holds 7 million one-byte
varints. Building them as a Python list first (what protobuf's ``list(values)`` or
``np.asarray(values)`` does) held the event loop for seconds and a gigabyte of memory for a
shape of [1]. Here the fields are walked on the wire instead: a packed field's element count
comes from its bytes (numpy counts varint ends), an unpacked or length-delimited one is walked
at most ``count + slack`` fields, and only a field whose count matches the shape is converted,
by numpy, straight to the raw bytes the rest of mmguard uses.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from proxy import pbwire
from proxy.errors import ErrorKind, ProxyError
from proxy.tensor import Payload, element_count, numpy_dtype


class _Field(NamedTuple):
    number: int
    name: str
    encoding: str  # varint, fixed32, fixed64 or bytes


_BOOL = _Field(1, "bool_contents", "varint")
_INT = _Field(2, "int_contents", "varint")
_INT64 = _Field(3, "int64_contents", "varint")
_UINT = _Field(4, "uint_contents", "varint")
_UINT64 = _Field(5, "uint64_contents", "varint")
_FP32 = _Field(6, "fp32_contents", "fixed32")
_FP64 = _Field(7, "fp64_contents", "fixed64")
_BYTES = _Field(8, "bytes_contents", "bytes")
_BY_NUMBER = {f.number: f for f in (_BOOL, _INT, _INT64, _UINT, _UINT64, _FP32, _FP64, _BYTES)}
FIELD_OF = {
    "BOOL": _BOOL, "INT8": _INT, "INT16": _INT, "INT32": _INT, "INT64": _INT64,
    "UINT8": _UINT, "UINT16": _UINT, "UINT32": _UINT, "UINT64": _UINT64,
    "FP32": _FP32, "FP64": _FP64, "BYTES": _BYTES,
}
_WIDTH = {"fixed32": 4, "fixed64": 8}
_SINGLE_WIRE = {"varint": pbwire.VARINT, "fixed32": pbwire.I32, "fixed64": pbwire.I64}
_SLACK = 64
"""Fields beyond the shape's count a walk visits before refusing (unknown or empty ones)."""


def contents_to_raw(name: str, datatype: str, shape: tuple[int, ...],
                    pieces: list[memoryview]) -> Payload:
    """The raw bytes of one input's typed contents (``pieces``: each ``contents`` value as it
    came, in order; protobuf merges them into one message). Refuses, naming the input, any
    count other than the shape's, a value outside the datatype, and contents in another
    datatype's field."""
    field = FIELD_OF.get(datatype)
    if field is None:
        raise _refuse(name, f"datatype {datatype} cannot be sent in typed contents; use "
                            "raw_input_contents")
    count = element_count(shape)
    values = _values(name, datatype, shape, field, count, pieces)
    held = sum(_count(name, field, wire, v) for wire, v in values)
    if held != count:
        raise _refuse(name, f"shape {list(shape)} needs {count} {datatype} elements, "
                            f"{field.name} holds {held}")
    return _convert(name, datatype, field, values)


def _values(name: str, datatype: str, shape: tuple[int, ...], field: _Field, count: int,
            pieces: list[memoryview]) -> list[tuple[int, memoryview]]:
    """(wire type, value) of each occurrence of the datatype's field, in order."""
    budget = pbwire.Budget(count + _SLACK)
    found: list[tuple[int, memoryview]] = []
    try:
        for piece in pieces:
            for number, start, value, end in pbwire.fields(piece, budget):
                wire = pbwire.wire_type_at(piece, start)
                if number == field.number:
                    found.append((wire, piece[value:end]))
                elif number in _BY_NUMBER and (wire != pbwire.LEN or end > value):
                    raise _refuse(name, f"a {datatype} tensor's typed contents go in "
                                        f"{field.name}, not {_BY_NUMBER[number].name}")
    except pbwire.FieldLimit:  # the walk stops here, not at the end of a huge field list
        raise _refuse(name, f"shape {list(shape)} needs {count} {datatype} elements, the typed "
                            f"contents hold more than {count + _SLACK} fields") from None
    except pbwire.WireError as exc:
        raise _refuse(name, f"malformed typed contents: {exc}") from None
    return found


def _count(name: str, field: _Field, wire: int, value: memoryview) -> int:
    if field.encoding == "bytes":
        if wire != pbwire.LEN:
            raise _refuse(name, f"{field.name} has a field of wire type {wire}")
        return 1
    if wire == _SINGLE_WIRE[field.encoding]:
        return 1
    if wire != pbwire.LEN:
        raise _refuse(name, f"{field.name} has a field of wire type {wire}")
    if field.encoding == "varint":
        try:
            return pbwire.count_varints(value)
        except pbwire.WireError as exc:
            raise _refuse(name, f"malformed {field.name}: {exc}") from None
    width = _WIDTH[field.encoding]
    if len(value) % width:
        raise _refuse(name, f"packed {field.name} has {len(value)} bytes, not a multiple of "
                            f"{width}")
    return len(value) // width


def _convert(name: str, datatype: str, field: _Field,
             values: list[tuple[int, memoryview]]) -> Payload:
    if field.encoding == "bytes":
        return b"".join(len(v).to_bytes(4, "little") + bytes(v) for _, v in values)
    if field.encoding != "varint":  # fixed32 / fixed64 are already the little-endian raw form
        return values[0][1] if len(values) == 1 else b"".join(bytes(v) for _, v in values)
    # An unpacked varint's value bytes are a varint too: all of them in a row decode at once.
    joined = values[0][1] if len(values) == 1 else b"".join(bytes(v) for _, v in values)
    try:
        wide = pbwire.decode_varints(joined)
    except pbwire.WireError as exc:
        raise _refuse(name, f"malformed {field.name}: {exc}") from None
    if datatype == "BOOL":
        return bytes((wide != 0).tobytes())
    target = numpy_dtype(datatype)
    if target.kind == "i":  # int32 / int64 fields carry negatives sign-extended to 64 bits
        wide_signed = wide.view(np.int64)
        info = np.iinfo(target)
        out_of_range = (wide_signed < info.min) | (wide_signed > info.max)
        if out_of_range.any():
            raise _out_of_range(name, datatype, field, int(wide_signed[out_of_range][0]),
                                int(info.min), int(info.max))
        return wide_signed.astype(target).tobytes()
    top = np.iinfo(target).max
    if datatype != "UINT64" and bool((wide > top).any()):
        raise _out_of_range(name, datatype, field, int(wide[wide > top][0]), 0, int(top))
    return wide.astype(target).tobytes()


def _out_of_range(name: str, datatype: str, field: _Field, value: int, low: int,
                  high: int) -> ProxyError:
    return _refuse(name, f"{field.name} holds {value}, outside the {datatype} range "
                         f"[{low}, {high}]")


def _refuse(name: str, detail: str) -> ProxyError:
    return ProxyError(ErrorKind.INVALID_ARGUMENT, f"input '{name}': {detail}")
