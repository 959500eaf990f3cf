"""Tensors in wire form.

A ``Tensor`` keeps its payload as the front received it: raw little-endian bytes (gRPC
``raw_input_contents``, a slice of an HTTP binary body) or the JSON list. Shape and byte size are
known without decoding; ``numpy()`` is a zero-copy view built only when someone asks for it.
Raw bytes are never unpacked into Python lists: a JSON client gets a list only because JSON has
no other way to carry numbers.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np
from numpy.typing import NDArray

from proxy.errors import ErrorKind, ProxyError

Payload = bytes | bytearray | memoryview

# v2 datatype name -> numpy dtype (little-endian). BF16 has no numpy type: its bits travel as
# uint16. BYTES elements are length-prefixed (4-byte little-endian) byte strings.
_NUMPY: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"), "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"), "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"), "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"), "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"), "FP32": np.dtype("<f4"), "FP64": np.dtype("<f8"),
    "BF16": np.dtype("<u2"),
    "BYTES": np.dtype(np.object_),
}
DATATYPES = frozenset(_NUMPY)
_FROM_NUMPY = {v: k for k, v in _NUMPY.items() if k not in ("BF16", "BYTES")}


def itemsize(datatype: str) -> int | None:
    """Bytes per element, or None for BYTES (variable length)."""
    return None if datatype == "BYTES" else _NUMPY[datatype].itemsize


def numpy_dtype(datatype: str) -> np.dtype[Any]:
    return _NUMPY[datatype]


def datatype_of(arr: NDArray[Any]) -> str:
    if arr.dtype.kind in ("O", "S", "U"):
        return "BYTES"
    try:
        return _FROM_NUMPY[arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype]
    except KeyError:
        raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                         f"numpy dtype {arr.dtype} has no v2 datatype") from None


def element_count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


MAX_DIM = 2**31 - 1
"""The largest dimension mmguard passes on."""
MAX_SPAN = 2**60 - 1
"""The most elements the non-zero dims of a shape with a zero dim may multiply to: one more, in
8-byte items, passes numpy's 2**63 - 1 byte bound, and numpy refuses such a shape even with 0
elements (a shape without a zero dim is held to its payload's size instead)."""

# Bounds on the repeated parts of one request, checked before anything is built from them: each
# costs Python time and memory per entry, and a 7 MiB body holds millions of tiny entries.
MAX_RANK = 64
"""The most dimensions a tensor may have (numpy's own limit; no array library takes more)."""
MAX_TENSORS = 4096
"""The most inputs (and, separately, requested outputs) one request may name."""
MAX_PARAMETERS = 1024
"""The most entries one ``parameters`` map (of the request, an input, an output) may hold."""


@dataclass(slots=True)
class Tensor:
    """One named tensor. Exactly one of ``raw`` / ``data`` is set."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    raw: Payload | None = None
    data: list[Any] | None = None
    parameters: dict[str, Any] = field(default_factory=dict)

    @property
    def elements(self) -> int:
        return element_count(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of payload as received (raw length; for JSON, the raw size it would take)."""
        if self.raw is not None:
            return len(self.raw)
        size = itemsize(self.datatype)
        if size is not None:
            return self.elements * size
        return len(self.to_raw())

    def raw_bytes(self) -> Payload:
        """The payload as raw bytes, converting JSON data once if needed."""
        if self.raw is None:
            self.raw = self.to_raw()
            self.data = None
        return self.raw

    def to_raw(self) -> bytes:
        if self.raw is not None:
            return bytes(self.raw)
        assert self.data is not None
        if self.datatype == "BYTES":
            return encode_bytes_elements(flatten(self.data))
        if self.datatype in ("BF16", "FP16", "FP32"):
            wide = np.asarray(self.data, dtype=np.float64).reshape(-1)
            with np.errstate(over="ignore"):  # overflow is refused just below, by value
                narrow = wide.astype(np.float16 if self.datatype == "FP16" else np.float32)
            overflow = np.isfinite(wide) & ~np.isfinite(narrow)
            if overflow.any():
                raise OverflowError(f"{wide[overflow][0]!r} is outside the {self.datatype} range")
            if self.datatype == "BF16":  # JSON carries BF16 as numbers: keep the top 16 bits
                return _float_to_bf16(narrow).tobytes()
            return narrow.tobytes()
        arr = np.asarray(self.data, dtype=_NUMPY[self.datatype]).reshape(-1)
        return arr.tobytes()

    def numpy(self) -> NDArray[Any]:
        """A view of the payload in its shape. Zero-copy for raw payloads (read-only)."""
        if self.datatype == "BYTES":
            items = (decode_bytes_elements(self.raw, self.elements) if self.raw is not None
                     else [_as_bytes(x) for x in flatten(self.data or [])])
            out = np.empty(len(items), dtype=np.object_)
            out[:] = items
            return out.reshape(self.shape)
        if self.raw is not None:
            return np.frombuffer(self.raw, dtype=_NUMPY[self.datatype]).reshape(self.shape)
        if self.datatype == "BF16":  # JSON numbers → the bfloat16 bits the raw form holds
            return np.frombuffer(self.to_raw(), dtype=np.uint16).reshape(self.shape)
        return np.asarray(self.data, dtype=_NUMPY[self.datatype]).reshape(self.shape)

    def to_list(self) -> list[Any]:
        """Flat JSON-able list (only for a JSON client: this is the one place lists are built)."""
        arr = self.numpy().reshape(-1)
        if self.datatype == "BYTES":
            return [_json_text(x) for x in arr]
        if self.datatype == "BF16":
            arr = _bf16_to_float(np.asarray(arr))
        values: list[Any] = arr.tolist()
        return values

    def check_payload(self, request: tuple[str, str] | None = None) -> None:
        """Raise INVALID_ARGUMENT unless the payload matches shape × datatype. ``request``: the
        (model, request id) of a client's request, so a BYTES input's framing is refused in
        Triton's words."""
        self.check_shape(request)
        if self.raw is None:
            return
        size = itemsize(self.datatype)
        if size is None:
            check_bytes_elements(self.raw, self.elements, name=self.name, request=request)
            return
        expected = self.elements * size
        if len(self.raw) != expected:
            raise ProxyError(
                ErrorKind.INVALID_ARGUMENT,
                f"input '{self.name}': {self.datatype} shape {list(self.shape)} needs "
                f"{expected} bytes, got {len(self.raw)}",
            )

    def check_shape(self, request: tuple[str, str] | None = None) -> None:
        """Raise INVALID_ARGUMENT unless datatype and shape are ones mmguard passes on.
        ``request``: the (model, request id) of a client's request, so a negative dim is
        refused with Triton's phrase first."""
        if self.datatype not in DATATYPES:
            raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                             f"input '{self.name}': unknown datatype '{self.datatype}'")
        if len(self.shape) > MAX_RANK:
            raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                             f"input '{self.name}': shape has {len(self.shape)} dims; mmguard "
                             f"takes at most {MAX_RANK}")
        if any(d < 0 for d in self.shape):
            shown = f"shape {list(self.shape)} has a negative dim"
            if request is not None:
                model, rid = request
                shown = (f"[request id: {rid or '<id_unknown>'}] unexpected shape for input "
                         f"'{self.name}' for model '{model}': {shown}")
            raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                             shown if request is not None else f"input '{self.name}': {shown}")
        if any(d > MAX_DIM for d in self.shape):
            # No array (numpy, ONNX Runtime, Triton) takes such a dim, even with 0 elements.
            raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                             f"input '{self.name}': shape {list(self.shape)} has a dim above "
                             f"{MAX_DIM}")
        if 0 in self.shape and element_count(tuple(d for d in self.shape if d)) > MAX_SPAN:
            raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                             f"input '{self.name}': shape {list(self.shape)} has a zero dim, "
                             f"but its other dims multiply past {MAX_SPAN}: no array takes "
                             f"that shape, even with 0 elements")

    @classmethod
    def from_numpy(cls, name: str, arr: NDArray[Any], datatype: str | None = None) -> Tensor:
        dt = datatype or datatype_of(arr)
        shape = tuple(int(d) for d in arr.shape)
        if dt == "BYTES":
            raw: Payload = encode_bytes_elements([_as_bytes(x) for x in arr.reshape(-1)])
        else:
            raw = memoryview(np.ascontiguousarray(arr)).cast("B")  # type: ignore[arg-type]
        return cls(name, dt, shape, raw=raw)


def encode_bytes_elements(items: list[Any]) -> bytes:
    parts = []
    for item in items:
        b = _as_bytes(item)
        parts.append(struct.pack("<I", len(b)))
        parts.append(b)
    return b"".join(parts)


_PREFIX = struct.Struct("<I")


def check_bytes_elements(raw: Payload, count: int, name: str = "",
                         request: tuple[str, str] | None = None) -> None:
    """Raise INVALID_ARGUMENT unless ``raw`` frames exactly ``count`` BYTES elements.

    The cost is bounded by ``count``, never by what the payload claims: a payload that cannot
    hold ``count`` prefixes is refused at once, a payload of equal-length elements (the common
    case, and a buffer of millions of empty ones) is checked by numpy in one pass, and any other
    is walked only up to the first element past the shape's count. ``request``: see
    ``Tensor.check_payload``."""
    view = memoryview(raw).cast("B")
    try:
        uniform = _uniform_length(view, count, name)
    except ProxyError:
        if request is None:
            raise
        uniform = None  # walked for Triton's words: cheap, the payload is short of prefixes
    if uniform is None:
        _walk_bytes(view, count, name, None, request)


def decode_bytes_elements(raw: Payload, count: int, name: str = "") -> list[bytes]:
    """Split length-prefixed BYTES elements; raise INVALID_ARGUMENT if the framing is broken."""
    view = memoryview(raw).cast("B")
    length = _uniform_length(view, count, name)
    if length == 0:
        return [b""] * count
    if length is not None:
        records = np.frombuffer(view, dtype=np.dtype([("n", "<u4"), ("s", f"V{length}")]))
        items: list[bytes] = records["s"].tolist()
        return items
    starts: list[int] = []
    _walk_bytes(view, count, name, starts)
    ends = [s - 4 for s in starts[1:]] + [len(view)]  # each element ends at the next prefix
    data = view.tobytes()  # one copy: slicing bytes is cheaper than a memoryview per element
    return [data[a:b] for a, b in zip(starts, ends, strict=True)]


def _uniform_length(view: memoryview, count: int, name: str) -> int | None:
    """The length of every element when all ``count`` are equally long, else None."""
    size = len(view)
    if count * 4 > size:  # every element takes at least its 4-byte length prefix
        raise _framing_error(name, f"shape needs {count} BYTES elements (at least {count * 4} "
                                   f"bytes of length prefixes), got {size} bytes")
    if count == 0:
        if size:
            raise _framing_error(name, f"shape needs 0 BYTES elements, got {size} bytes")
        return 0
    (first,) = _PREFIX.unpack_from(view, 0)
    if count * (4 + first) != size:
        return None
    prefixes: NDArray[np.uint32] = np.ndarray((count,), dtype="<u4", buffer=view,
                                              strides=(4 + first,))
    return first if bool((prefixes == first).all()) else None


def _walk_bytes(view: memoryview, count: int, name: str, starts: list[int] | None,
                request: tuple[str, str] | None = None) -> None:
    """Walk at most ``count`` prefixes (a payload holding more elements than the shape is
    refused past the shape's last one, not counted to its end); ``starts`` gets where each
    element's bytes start. A client's request (``request``) is refused in Triton's words."""
    size, pos = len(view), 0
    unpack = _PREFIX.unpack_from
    words = _TritonWords(name, request) if request is not None else None
    for i in range(count):
        if pos + 4 > size:
            if pos == size:
                raise (words.fewer(count, i) if words else
                       _framing_error(name, f"shape needs {count} BYTES elements, got {i}"))
            raise (words.cut_prefix(size - pos) if words else
                   _framing_error(name, f"BYTES element {i} has a cut length prefix"))
        (n,) = unpack(view, pos)
        pos += 4
        if pos + n > size:
            raise (words.past_end(n, size - pos) if words else _framing_error(
                name, f"BYTES element {i} declares {n} bytes, only {size - pos} remain"))
        if starts is not None:
            starts.append(pos)
        pos += n
    if pos != size:
        if words is not None and size - pos < 4:  # Triton reads the next prefix first
            raise words.cut_prefix(size - pos)
        raise (words.more(count) if words else _framing_error(
            name, f"shape needs {count} BYTES elements, got more: {size - pos} bytes follow "
                  f"element {count - 1}"))


def _framing_error(name: str, detail: str) -> ProxyError:
    return ProxyError(ErrorKind.INVALID_ARGUMENT, f"input '{name}': {detail}")


class _TritonWords:
    """How Triton refuses a BYTES input's framing (its core's checks, and its backends')."""

    def __init__(self, name: str, request: tuple[str, str]) -> None:
        model, rid = request
        self.name, self.model = name, model
        self.lead = f"[request id: {rid or '<id_unknown>'}] "

    def _error(self, text: str) -> ProxyError:
        return ProxyError(ErrorKind.INVALID_ARGUMENT, text)

    def fewer(self, count: int, got: int) -> ProxyError:
        return self._error(f"{self.lead}expected {count} string elements for inference input "
                           f"'{self.name}' for model '{self.model}', got {got}")

    def more(self, count: int) -> ProxyError:
        return self._error(f"{self.lead}unexpected number of string elements {count + 1} for "
                           f"inference input '{self.name}' for model '{self.model}', expecting "
                           f"{count}")

    def cut_prefix(self, left: int) -> ProxyError:
        return self._error(f"{self.lead}incomplete string length indicator for inference input "
                           f"'{self.name}' for model '{self.model}', expecting 4 bytes but only "
                           f"{left} bytes available. Please make sure the string length "
                           "indicator is in one buffer.")

    def past_end(self, length: int, left: int) -> ProxyError:
        return self._error(f"incomplete string data for inference input '{self.name}', "
                           f"expecting string of length {length} but only {left} bytes "
                           "available")


def flatten(data: Any) -> list[Any]:
    if not isinstance(data, list):
        return [data]
    out: list[Any] = []
    for x in data:
        out.extend(flatten(x) if isinstance(x, list) else [x])
    return out


def _as_bytes(x: Any) -> bytes:
    if isinstance(x, bytes):
        return x
    if isinstance(x, str):
        return x.encode()
    if isinstance(x, (bytearray, memoryview, np.bytes_)):
        return bytes(x)
    return str(x).encode()


def _json_text(x: bytes) -> str:
    """A BYTES element as JSON text. Bytes that are not UTF-8 are kept as they are (escaped
    surrogates, written back as the bytes by ``json_bytes``), as Triton writes them: they were
    read as latin-1, so a client got other bytes than the model's."""
    return x.decode("utf-8", "surrogateescape")


def json_bytes(doc: Any) -> bytes:
    """``doc`` as compact JSON, in UTF-8, with the bytes of ``_json_text``'s escapes restored."""
    text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False)
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate of another kind: escaped, as JSON allows
        return json.dumps(doc, separators=(",", ":")).encode()


def _bf16_to_float(bits: NDArray[Any]) -> NDArray[Any]:
    """bfloat16 bits → float32 values (exact: bfloat16 is float32's top half)."""
    out: NDArray[Any] = np.asarray(bits, dtype=np.uint16).view(ml_dtypes.bfloat16).astype(
        np.float32)
    return out


def _float_to_bf16(values: NDArray[Any]) -> NDArray[np.uint16]:
    """float32 → bfloat16 bits, rounding to nearest even (ml_dtypes' cast, as torch's)."""
    with np.errstate(invalid="ignore", over="ignore"):  # NaN stays NaN, overflow is inf
        out: NDArray[np.uint16] = np.asarray(values, dtype=np.float32).astype(
            ml_dtypes.bfloat16).view(np.uint16)
    return out
