"""Tensors in wire form.

A ``Tensor`` keeps its payload as the front received it: raw little-endian bytes (gRPC
``raw_input_contents``, a slice of an HTTP binary body) or the JSON list. Shape and byte size are
known without decoding; ``numpy()`` is a zero-copy view built only when someone asks for it.
Raw bytes are never unpacked into Python lists: a JSON client gets a list only because JSON has
no other way to carry numbers.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

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
            return encode_bytes_elements(_flatten(self.data))
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
                     else [_as_bytes(x) for x in _flatten(self.data or [])])
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

    def check_payload(self) -> None:
        """Raise INVALID_ARGUMENT unless the payload matches shape × datatype."""
        if self.datatype not in DATATYPES:
            raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                             f"input '{self.name}': unknown datatype '{self.datatype}'")
        if any(d < 0 for d in self.shape):
            raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                             f"input '{self.name}': shape {list(self.shape)} has a negative dim")
        if any(d > MAX_DIM for d in self.shape):
            # No array (numpy, ONNX Runtime, Triton) takes such a dim, even with 0 elements.
            raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                             f"input '{self.name}': shape {list(self.shape)} has a dim above "
                             f"{MAX_DIM}")
        if self.raw is None:
            return
        size = itemsize(self.datatype)
        if size is None:
            decode_bytes_elements(self.raw, self.elements, name=self.name)
            return
        expected = self.elements * size
        if len(self.raw) != expected:
            raise ProxyError(
                ErrorKind.INVALID_ARGUMENT,
                f"input '{self.name}': {self.datatype} shape {list(self.shape)} needs "
                f"{expected} bytes, got {len(self.raw)}",
            )

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


def decode_bytes_elements(raw: Payload, count: int, name: str = "") -> list[bytes]:
    """Split length-prefixed BYTES elements; raise INVALID_ARGUMENT if the framing is broken."""
    view = memoryview(raw).cast("B")
    items: list[bytes] = []
    pos = 0
    while pos < len(view):
        if pos + 4 > len(view):
            raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                             f"input '{name}': BYTES element {len(items)} has a cut length prefix")
        (n,) = struct.unpack_from("<I", view, pos)
        pos += 4
        if pos + n > len(view):
            raise ProxyError(
                ErrorKind.INVALID_ARGUMENT,
                f"input '{name}': BYTES element {len(items)} declares {n} bytes, "
                f"only {len(view) - pos} remain",
            )
        items.append(bytes(view[pos:pos + n]))
        pos += n
    if len(items) != count:
        raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                         f"input '{name}': shape needs {count} BYTES elements, got {len(items)}")
    return items


def _flatten(data: Any) -> list[Any]:
    if not isinstance(data, list):
        return [data]
    out: list[Any] = []
    for x in data:
        out.extend(_flatten(x) if isinstance(x, list) else [x])
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
    try:
        return x.decode()
    except UnicodeDecodeError:
        return x.decode("latin-1")


def _bf16_to_float(bits: NDArray[Any]) -> NDArray[Any]:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _float_to_bf16(values: NDArray[Any]) -> NDArray[np.uint16]:
    """float32 → bfloat16 bits, rounding to nearest even (NaN stays a quiet NaN)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    out = rounded.astype(np.uint16)
    out[np.isnan(values)] = 0x7FC0
    return out
