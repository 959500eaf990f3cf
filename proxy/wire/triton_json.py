"""The JSON types Triton's HTTP front reads in a v2 request, and its words when a value is not
of its type.

Triton reads each field through a typed accessor (``TritonJson``: ``AsBool``, ``AsInt``,
``AsUInt``, ``AsDouble``, ``AsString``, ``MemberAsArray``) and refuses a value of another JSON
type in so many words, prefixed by the field (``Unable to parse 'data': attempt to access JSON
non-boolean as boolean``). Python's ``json`` and numpy convert instead: ``"false"`` was a true
BOOL, ``"1"``, ``true`` and ``"nan"`` were FP32 numbers, ``1e3`` an INT64, ``5`` and ``true``
BYTES text. Where mmguard re-encodes the request for another protocol (a ``triton_grpc``
backend, ONNX Runtime) the model got values the client never sent, and where it forwards the
body (``triton_http``) the same request was refused: two answers to one request.

What MUST hold: every field Triton types is checked here with Triton's accessor's rule, and a
value of another type is refused ``INVALID_ARGUMENT`` with Triton's words first (mmguard adds
which element). A JSON ``int`` is an integer literal (``1``), a ``float`` any literal with a
fraction or an exponent (``1.0``, ``1e3``), as rapidjson tells ``IsInt64`` from ``IsDouble``.
"""

from __future__ import annotations

from typing import Any

from proxy.errors import ErrorKind, ProxyError, bounded

_WORDS = {
    "bool": "attempt to access JSON non-boolean as boolean",
    "int": "attempt to access JSON non-signed-integer as signed-integer",
    "uint": "attempt to access JSON non-unsigned-integer as unsigned-integer",
    "number": "attempt to access JSON non-number as double",
    "string": "attempt to access JSON non-string as string",
    "array": "attempt to access JSON non-array as array",
}

DATA_KIND = {"BOOL": "bool", "BYTES": "string", "FP32": "number", "FP64": "number",
             **{f"INT{b}": "int" for b in (8, 16, 32, 64)},
             **{f"UINT{b}": "uint" for b in (8, 16, 32, 64)}}
"""How Triton reads a JSON ``data`` element of each datatype (FP16 and BF16: not at all)."""

_TYPES: dict[str, set[type]] = {"bool": {bool}, "string": {str}, "number": {int, float},
                                "int": {int}, "uint": {int}}

REQUEST_PARAMETERS = {"sequence_start": "bool", "sequence_end": "bool", "priority": "uint",
                      "timeout": "uint", "binary_data_output": "bool"}
"""The request parameters Triton reads, by type (``sequence_id``: an unsigned integer or a
string, checked apart)."""

OUTPUT_PARAMETERS = {"binary_data": ("bool", "Unable to parse 'binary_data'"),
                     "classification": ("uint", "Unable to set 'classification'"),
                     "shared_memory_region": ("string", "Unable to parse 'shared_memory_region'"),
                     "shared_memory_offset": ("uint", "Unable to parse 'shared_memory_offset'"),
                     "shared_memory_byte_size": ("uint",
                                                 "Unable to parse 'shared_memory_byte_size'")}
INPUT_PARAMETERS = {k: v for k, v in OUTPUT_PARAMETERS.items() if k.startswith("shared_memory")}


def is_kind(value: Any, kind: str) -> bool:
    t = type(value)
    if kind == "bool":
        return t is bool
    if kind == "int":
        return t is int and -2**63 <= value < 2**63
    if kind == "uint":
        return t is int and 0 <= value < 2**64
    if kind == "number":
        return t is int or t is float
    if kind == "string":
        return t is str
    return t is list


def refused(lead: str, kind: str, detail: str = "") -> ProxyError:
    return ProxyError(ErrorKind.INVALID_ARGUMENT,
                      f"{lead}: {_WORDS[kind]}" + (f" ({detail})" if detail else ""))


def expect(value: Any, kind: str, lead: str, detail: str = "") -> None:
    """``value`` read as Triton reads it with ``lead`` (``Unable to parse 'x'``)."""
    if not is_kind(value, kind):
        raise refused(lead, kind, detail or f"got {bounded(repr(value), 64)}")


def check_parameters(params: dict[str, Any], typed: dict[str, tuple[str, str]],
                     where: str) -> None:
    for key, (kind, lead) in typed.items():
        if key in params:
            expect(params[key], kind, lead, f"{where}: got {bounded(repr(params[key]), 64)}")


def check_request_parameters(params: dict[str, Any]) -> None:
    for key, kind in REQUEST_PARAMETERS.items():
        if key in params:
            expect(params[key], kind, f"Unable to parse '{key}'")
    if "sequence_id" in params and not (is_kind(params["sequence_id"], "uint")
                                        or is_kind(params["sequence_id"], "string")):
        expect(params["sequence_id"], "string", "Unable to parse 'sequence_id'")


def check_data(name: str, datatype: str, flat: list[Any]) -> None:
    """Every element of input ``name``'s JSON ``data`` (flattened) of the type Triton reads for
    ``datatype``; FP16 and BF16 are refused in Triton's words (JSON cannot carry them exactly)."""
    if datatype in ("FP16", "BF16"):
        raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                         f"receiving {datatype} data via JSON is not supported. Please use the "
                         f"binary data format for input {name}")
    kind = DATA_KIND.get(datatype)
    if kind is None:
        return
    allowed = _TYPES[kind]
    if not set(map(type, flat)) <= allowed or (kind in ("int", "uint") and flat and not (
            (-2**63 if kind == "int" else 0) <= min(flat)
            and max(flat) < (2**63 if kind == "int" else 2**64))):
        at = next(i for i, x in enumerate(flat) if not is_kind(x, kind))
        lead = ("Unable to parse JSON bytes array" if kind == "string"  # sized first
                else "Unable to parse 'data'")
        raise refused(lead, kind, f"input '{name}' is {datatype}; its element {at} is "
                      f"{bounded(repr(flat[at]), 64)}")
