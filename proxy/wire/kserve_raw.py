"""The binary tensor extension's raw form: ``Inference-Header-Content-Length: 0`` and a body of
only the one input's bytes, read as Triton reads it.

Triton (2.51) takes the header's leading integer (C ``atoi``: no number at all is 0), so any
value that reads as 0 selects the raw form. The model must have exactly one input; its
datatype is the model's, its shape the config dims with a batch of 1 in front when the model
batches, one variable dim sized by the body; a BYTES input must be one element, and its bytes
get their 4-byte length in front. Every output is answered in binary. Refusals are Triton's own
texts, word for word, because its clients and tests match on them.
"""

from __future__ import annotations

import math
import re

from proxy.call import Call, Wire
from proxy.contract import ModelContract
from proxy.errors import ErrorKind, ProxyError
from proxy.tensor import Payload, Tensor, itemsize
from proxy.wire.numbers import MAX_COUNT_DIGITS, shown_value


def bad(message: str) -> ProxyError:
    return ProxyError(ErrorKind.INVALID_ARGUMENT, message)


def header_length_value(text: str, body_size: int) -> int:
    """``Inference-Header-Content-Length`` as Triton 2.51 reads it: the leading integer of the
    value (C ``atoi``: junk after it is ignored, no number at all is 0, the raw form), which
    must lie in [0, body size]."""
    value = header_length_number(text, body_size)
    if not 0 <= value <= body_size:
        raise _out_of_range(text, body_size)
    return value


def _out_of_range(text: str, body_size: int) -> ProxyError:
    shown = text if len(text) <= 40 else f"{text[:40]}... ({len(text)} characters)"
    return bad(f"inference header size should be in range (0, {body_size}), got: {shown}")


def header_length_number(text: str, body_size: int | None = None) -> int:
    """The leading integer of ``Inference-Header-Content-Length`` as C's ``atoi`` reads it (no
    number at all is 0); one of more than ``MAX_COUNT_DIGITS`` digits is a 400, not a 500 (and
    not a 4301-digit conversion): out of the body's range when its size is known."""
    if text.isdigit() and text.isascii() and len(text) <= MAX_COUNT_DIGITS:
        return int(text)  # the usual value: what the match below would read, without it
    match = _LEADING_INT.match(text)
    if match is None:
        return 0
    if len(match.group(0).strip().lstrip("+-")) > MAX_COUNT_DIGITS:
        if body_size is not None:
            raise _out_of_range(text, body_size)
        raise bad(f"Inference-Header-Content-Length must be an integer of at most "
                  f"{MAX_COUNT_DIGITS} ASCII digits, got {shown_value(text)}")
    return int(match.group(0))


_LEADING_INT = re.compile(r"[ \t\n\v\f\r]*[+-]?[0-9]+")


RAW_INPUT = "raw_input"
"""The name Triton gives the one input of a raw binary request in its error texts."""


def is_raw(body: bytes, header_length: str | None) -> bool:
    """A raw binary request: ``Inference-Header-Content-Length`` reads as 0, so the whole body
    is the bytes of the model's only input (the binary tensor extension's raw form)."""
    return header_length is not None and header_length_value(header_length, len(body)) == 0


def decode_raw_request(body: bytes, model: str, version: str, contract: ModelContract,
                       content_type: str | None = None) -> Call:
    """A raw binary request as Triton reads it: the model's only input, its datatype from the
    model, its shape from the config dims (a batch of 1 in front when the model batches; one
    variable dim sized by the body); every output answered in binary. Refusals carry Triton's
    own texts."""
    if len(contract.inputs) != 1:
        raise bad(f"{_NO_ID}Raw request must only have 1 input (found 1) to be deduced but got "
                  f"{len(contract.inputs)} inputs in '{model}' model configuration")
    spec = contract.inputs[0]
    batch = contract.max_batch_size > 0
    dims = list(spec.dims[1:] if batch and spec.dims else spec.dims)
    if dims.count(-1) > 1:
        raise bad(f"{_NO_ID}The shape of the raw input '{spec.name}' can not be deduced because "
                  "there are more than one variable-sized dimension")
    count = math.prod(d for d in dims if d != -1)
    size = itemsize(spec.datatype)
    raw: Payload = body
    if size is None:
        if -1 in dims or count != 1:
            raise bad(f"{_NO_ID}For BYTE datatype raw input '{spec.name}', the model must have "
                      "input shape [1]")
        raw = len(body).to_bytes(4, "little") + body  # Triton prepends the element's length
    elif -1 in dims:
        dims[dims.index(-1)] = len(body) // (count * size) if count else 0
    shape = ([1] if batch else []) + dims
    if size is not None and math.prod(shape) * size != len(body):
        raise bad(f"{_NO_ID}input byte size mismatch for input '{RAW_INPUT}' for model "
                  f"'{model}'. Expected {math.prod(shape) * size}, got {len(body)}")
    t = Tensor(spec.name, spec.datatype, tuple(shape), raw=memoryview(raw))
    t.check_payload((model, ""))
    return Call(model=model, version=version, inputs=[t],
                parameters={"binary_data_output": True}, front="http",
                wire=Wire("http", body, 0, content_type))


_NO_ID = "[request id: <id_unknown>] "
"""How Triton begins a request's error when the request has no id (a raw one never has)."""


def check_byte_size(t: Tensor, model: str, request_id: str = "") -> None:
    """A fixed-size datatype's bytes against its shape, refused as Triton's core refuses them
    (raw_input_contents, binary_data_size, and the raw form alike)."""
    t.check_shape((model, request_id))
    size = itemsize(t.datatype)
    if t.raw is not None and size is not None and len(t.raw) != t.elements * size:
        raise bad(f"[request id: {request_id or '<id_unknown>'}] input byte size mismatch for "
                  f"input '{t.name}' for model '{model}'. Expected {t.elements * size}, got "
                  f"{len(t.raw)} ({t.datatype} shape {list(t.shape)})")
