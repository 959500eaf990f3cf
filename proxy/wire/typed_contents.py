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

from array import array
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from proxy.errors import ErrorKind, ProxyError
from proxy.tensor import Payload, element_count, numpy_dtype
from proxy.wire import pbwire


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
_TYPE_OF = {1: "BOOL", 2: "INT32", 3: "INT64", 4: "UINT32", 5: "UINT64", 6: "FP32", 7: "FP64",
            8: "BYTES"}
"""The datatype Triton names for each typed-contents field when it is the wrong one."""
_SINGLE_WIRE = {"varint": pbwire.VARINT, "fixed32": pbwire.I32, "fixed64": pbwire.I64}
_SLACK = 64
"""Other fields (unknown ones, empty packed ones) a walk passes before refusing."""


def contents_to_raw(name: str, datatype: str, shape: tuple[int, ...],
                    pieces: list[memoryview], model: str | None = None,
                    request_id: str = "") -> Payload:
    """The raw bytes of one input's typed contents (``pieces``: each ``contents`` value as it
    came, in order; protobuf merges them into one message). Refuses, naming the input, any
    count other than the shape's, a value outside the datatype, and contents in another
    datatype's field; with ``model`` (a client's request), a wrong field or count begins with
    Triton's own words for it."""
    field = FIELD_OF.get(datatype)
    if field is None:
        raise _refuse(name, f"datatype {datatype} cannot be sent in typed contents; use "
                            "raw_input_contents")
    count = element_count(shape)
    if field is _BYTES and len(pieces) == 1:
        uniform = _uniform_bytes_contents(pieces[0], count)
        if uniform is not None:
            return uniform
    data = pieces[0].tobytes() if len(pieces) == 1 else b"".join(p.tobytes() for p in pieces)
    found = _Found(name, datatype, shape, field, count)
    found.model, found.request_id = model, request_id
    offset = 0
    try:
        for i, piece in enumerate(pieces):
            found.walk(data, offset, offset + len(piece), last=i == len(pieces) - 1)
            offset += len(piece)
    except pbwire.WireError as exc:
        raise _refuse(name, f"malformed typed contents: {exc}") from None
    if found.held != count:
        raise found.mismatch(str(found.held))
    return found.convert(data)


_BYTES_TAG = (_BYTES.number << 3) | pbwire.LEN


def _uniform_bytes_contents(piece: memoryview, count: int) -> bytes | None:
    """The raw form of ``count`` equal-length (< 128 bytes) ``bytes_contents`` elements and
    nothing else, framed by numpy in one pass; None for any other contents (then walked)."""
    if count == 0 or len(piece) < 2 or piece[0] != _BYTES_TAG or piece[1] & 0x80:
        return None
    length = piece[1]
    stride = 2 + length
    if len(piece) != count * stride:
        return None
    fields = np.frombuffer(piece, dtype=np.uint8).reshape(count, stride)
    if not (bool((fields[:, 0] == _BYTES_TAG).all()) and bool((fields[:, 1] == length).all())):
        return None
    framed = np.empty((count, 4 + length), dtype=np.uint8)
    framed[:, :4] = np.frombuffer(length.to_bytes(4, "little"), dtype=np.uint8)
    framed[:, 4:] = fields[:, 2:]
    return framed.tobytes()


class _Found:
    """The value ranges of one datatype's field, collected by a walk that stops as soon as
    they hold more elements than the shape (or too many other fields): its cost is bounded by
    the shape, whatever the contents claim. Ranges are kept as machine integers (``array``),
    never as one Python object per element."""

    def __init__(self, name: str, datatype: str, shape: tuple[int, ...], field: _Field,
                 count: int) -> None:
        self.name, self.datatype, self.shape, self.field = name, datatype, shape, field
        self.count = count
        self.held = 0
        self.others = 0
        self.starts = array("q")
        self.ends = array("q")
        self.single_tag = (field.number << 3) | _SINGLE_WIRE.get(field.encoding, pbwire.LEN)
        self.model: str | None = None
        self.request_id = ""

    def walk(self, data: bytes, pos: int, limit: int, last: bool) -> None:
        field, single_tag = self.field, self.single_tag
        starts, ends = self.starts, self.ends
        while pos < limit:
            # The common shapes inline (a one-byte tag and a short length or a small varint);
            # anything else through the general field reader.
            if data[pos] == single_tag and pos + 1 < limit and data[pos + 1] < 0x80:
                wire = single_tag & 7
                if wire == pbwire.LEN:
                    value, end = pos + 2, pos + 2 + data[pos + 1]
                elif wire == pbwire.VARINT:
                    value, end = pos + 1, pos + 2
                else:
                    value, end = pos + 1, pos + 1 + _WIDTH[field.encoding]
                if end > limit:
                    raise pbwire.WireError(f"{field.name} runs past the end")
                number = field.number
            else:
                number, wire, value, end = pbwire.field_at(data, pos, limit)
            if number == field.number:
                self.held += self._elements(wire, data, value, end)
                starts.append(value)
                ends.append(end)
                if self.held > self.count:  # exact when nothing follows (a packed field)
                    exact = last and end == limit
                    raise self.mismatch(str(self.held) if exact else f"more than {self.count}")
            elif number in _BY_NUMBER and (wire != pbwire.LEN or end > value):
                raise self.wrong_field(_BY_NUMBER[number])
            else:
                self.others += 1
                if self.others > _SLACK:
                    raise _refuse(self.name, f"typed contents hold more than {_SLACK} fields "
                                             f"besides {field.name}")
            pos = end

    def _elements(self, wire: int, data: bytes, value: int, end: int) -> int:
        encoding = self.field.encoding
        if encoding == "bytes" or wire == _SINGLE_WIRE[encoding]:
            if encoding == "bytes" and wire != pbwire.LEN:
                raise _refuse(self.name, f"{self.field.name} has a field of wire type {wire}")
            return 1
        if wire != pbwire.LEN:
            raise _refuse(self.name, f"{self.field.name} has a field of wire type {wire}")
        if encoding == "varint":
            if end > value and data[end - 1] & 0x80:
                raise _refuse(self.name, f"malformed {self.field.name}: a packed varint field "
                                         "ends inside a varint")
            run = data[value:end]
            return sum(b < 0x80 for b in run) if len(run) < 64 else pbwire.count_varints(
                memoryview(run))
        width = _WIDTH[encoding]
        if (end - value) % width:
            raise _refuse(self.name, f"packed {self.field.name} has {end - value} bytes, not a "
                                     f"multiple of {width}")
        return (end - value) // width

    def wrong_field(self, other: _Field) -> ProxyError:
        detail = (f"a {self.datatype} tensor's typed contents go in {self.field.name}, not "
                  f"{other.name}")
        if self.model is None:
            return _refuse(self.name, detail)
        return ProxyError(ErrorKind.INVALID_ARGUMENT,
                          f"unexpected explicit tensor data for input tensor '{self.name}' for "
                          f"model '{self.model}' of type '{_TYPE_OF[other.number]}', expected "
                          f"datatype '{self.datatype}' ({detail})")

    def mismatch(self, held: str) -> ProxyError:
        detail = (f"shape {list(self.shape)} needs {self.count} {self.datatype} elements, "
                  f"{self.field.name} holds {held}")
        width = None if self.field is _BYTES else numpy_dtype(self.datatype).itemsize
        if self.model is None or width is None:
            return _refuse(self.name, detail)
        got = str(int(held) * width) if held.isdigit() else f"more than {self.count * width}"
        return ProxyError(ErrorKind.INVALID_ARGUMENT,
                          f"[request id: {self.request_id or '<id_unknown>'}] input byte size "
                          f"mismatch for input '{self.name}' for model '{self.model}'. Expected "
                          f"{self.count * width}, got {got} ({detail})")

    def convert(self, data: bytes) -> Payload:
        begin = np.frombuffer(self.starts, dtype=np.int64)
        lengths = np.frombuffer(self.ends, dtype=np.int64) - begin
        source = np.frombuffer(data, dtype=np.uint8)
        if self.field.encoding == "bytes":
            return _framed(source, begin, lengths)
        joined = _gathered(source, begin, lengths)
        if self.field.encoding != "varint":  # fixed32 / fixed64: already the raw form
            return joined.tobytes()
        try:
            wide = pbwire.decode_varints(joined.data)
        except pbwire.WireError as exc:
            raise _refuse(self.name, f"malformed {self.field.name}: {exc}") from None
        return _narrowed(self.name, self.datatype, self.field, wide)


def _gathered(source: NDArray[np.uint8], begin: NDArray[np.int64],
              lengths: NDArray[np.int64]) -> NDArray[np.uint8]:
    """The bytes of every range, one after another (numpy fancy indexing, no Python loop)."""
    if len(begin) == 1:
        return source[int(begin[0]):int(begin[0] + lengths[0])]
    within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    gathered: NDArray[np.uint8] = source[np.repeat(begin, lengths) + within]
    return gathered


def _framed(source: NDArray[np.uint8], begin: NDArray[np.int64],
            lengths: NDArray[np.int64]) -> bytes:
    """BYTES raw framing (a 4-byte little-endian length before each element) of the ranges."""
    count = len(begin)
    total = int(lengths.sum())
    out_begin = 4 * np.arange(1, count + 1) + (np.cumsum(lengths) - lengths)
    framed = np.empty(4 * count + total, dtype=np.uint8)
    framed[(out_begin - 4)[:, None] + np.arange(4)] = (
        lengths.astype("<u4").view(np.uint8).reshape(count, 4))
    within = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    framed[np.repeat(out_begin, lengths) + within] = source[np.repeat(begin, lengths) + within]
    return framed.tobytes()


def _narrowed(name: str, datatype: str, field: _Field, wide: NDArray[np.uint64]) -> bytes:
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
