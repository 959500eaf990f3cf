"""Error kinds and the ONE table that maps them to HTTP status and gRPC code.

Every refusal in mmguard — a front's decode error, a filter's ``LocalReply``, a backend failure —
carries an ``ErrorKind``. Both fronts MUST encode a kind through ``STATUS`` and nothing else, so
the same failure never gets a 400 on one protocol and INTERNAL on the other (KServe's python
server has exactly that bug).
"""

from __future__ import annotations

import asyncio
import enum
import re
from collections.abc import Iterable
from typing import NamedTuple

import grpc

MAX_MESSAGE_CHARS = 1000
"""The longest error message mmguard sends. gRPC carries the message as percent-encoded
``grpc-message`` metadata, and clients refuse metadata past 8 KiB (RESOURCE_EXHAUSTED instead of
the real error); 1000 characters stay under that even when every one is escaped."""

MAX_HEADER_CHARS = 512
"""The longest value of an ``mmguard-*`` header or trailer (a decision's detail). The quality
filter's scores (~300 characters with every signal) fit; a handful of decisions together stay
well under the 8 KiB a gRPC client takes in metadata."""

SHOWN_NAMES = 5
"""How many names an error lists before it gives the count of the rest."""


def bounded(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` cut to at most ``limit`` characters; a cut says how much was left out."""
    if len(text) <= limit:
        return text
    tail = f" ... [cut: {len(text) - limit} more characters]"
    return text[:max(0, limit - len(tail))] + tail


def header_value(text: str) -> str:
    """``text`` as an ``mmguard-*`` header / trailer value: printable ASCII only (gRPC refuses
    any other byte in metadata with INTERNAL "Invalid metadata"; HTTP has no encoding for it),
    escaped, then bounded to ``MAX_HEADER_CHARS``."""
    if not (text.isascii() and text.isprintable()):
        text = text.encode("ascii", "backslashreplace").decode()
        text = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)
    return bounded(text, MAX_HEADER_CHARS)


def name_list(names: Iterable[str], shown: int = SHOWN_NAMES) -> str:
    """``['a', 'b', ... and N more]``: the first few names of a list that may be huge."""
    items = list(names)
    head = ", ".join(repr(n if len(n) <= 64 else n[:61] + "...") for n in items[:shown])
    more = len(items) - shown
    return f"[{head}, ... and {more} more]" if more > 0 else f"[{head}]"


class ErrorKind(enum.Enum):
    INVALID_ARGUMENT = "invalid_argument"
    UNPROCESSABLE = "unprocessable"  # well-formed but refused on content (quality)
    NOT_FOUND = "not_found"
    TOO_LARGE = "too_large"
    OVERLOADED = "overloaded"
    UNAVAILABLE = "unavailable"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    UNIMPLEMENTED = "unimplemented"
    FAILED_PRECONDITION = "failed_precondition"
    CANCELLED = "cancelled"
    UNAUTHENTICATED = "unauthenticated"
    PERMISSION_DENIED = "permission_denied"
    INTERNAL = "internal"
    BAD_GATEWAY = "bad_gateway"  # a backend answer mmguard cannot read: malformed, or bytes that
    # do not fit their shape; HTTP 502, gRPC INTERNAL (gRPC has no status of its own for it)
    ALREADY_EXISTS = "already_exists"  # a shared memory region name taken (Triton: 400 too)


class Status(NamedTuple):
    http: int
    grpc: grpc.StatusCode


STATUS: dict[ErrorKind, Status] = {
    # First: where a lookup by HTTP status keeps the last kind, 400 stays INVALID_ARGUMENT.
    ErrorKind.ALREADY_EXISTS: Status(400, grpc.StatusCode.ALREADY_EXISTS),
    ErrorKind.INVALID_ARGUMENT: Status(400, grpc.StatusCode.INVALID_ARGUMENT),
    ErrorKind.UNPROCESSABLE: Status(422, grpc.StatusCode.INVALID_ARGUMENT),
    ErrorKind.NOT_FOUND: Status(404, grpc.StatusCode.NOT_FOUND),
    ErrorKind.TOO_LARGE: Status(413, grpc.StatusCode.RESOURCE_EXHAUSTED),
    ErrorKind.OVERLOADED: Status(429, grpc.StatusCode.RESOURCE_EXHAUSTED),
    ErrorKind.UNAVAILABLE: Status(503, grpc.StatusCode.UNAVAILABLE),
    ErrorKind.DEADLINE_EXCEEDED: Status(504, grpc.StatusCode.DEADLINE_EXCEEDED),
    ErrorKind.UNIMPLEMENTED: Status(501, grpc.StatusCode.UNIMPLEMENTED),
    ErrorKind.FAILED_PRECONDITION: Status(412, grpc.StatusCode.FAILED_PRECONDITION),
    ErrorKind.CANCELLED: Status(499, grpc.StatusCode.CANCELLED),
    ErrorKind.UNAUTHENTICATED: Status(401, grpc.StatusCode.UNAUTHENTICATED),
    ErrorKind.PERMISSION_DENIED: Status(403, grpc.StatusCode.PERMISSION_DENIED),
    ErrorKind.INTERNAL: Status(500, grpc.StatusCode.INTERNAL),
    ErrorKind.BAD_GATEWAY: Status(502, grpc.StatusCode.INTERNAL),
}

# Reverse lookups for errors that come back from a backend, so they pass through with their code.
_FROM_GRPC: dict[grpc.StatusCode, ErrorKind] = {
    grpc.StatusCode.INVALID_ARGUMENT: ErrorKind.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND: ErrorKind.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ErrorKind.OVERLOADED,
    grpc.StatusCode.UNAVAILABLE: ErrorKind.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: ErrorKind.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNIMPLEMENTED: ErrorKind.UNIMPLEMENTED,
    grpc.StatusCode.FAILED_PRECONDITION: ErrorKind.FAILED_PRECONDITION,
    grpc.StatusCode.CANCELLED: ErrorKind.CANCELLED,
    grpc.StatusCode.UNAUTHENTICATED: ErrorKind.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED: ErrorKind.PERMISSION_DENIED,
    grpc.StatusCode.OUT_OF_RANGE: ErrorKind.INVALID_ARGUMENT,
    grpc.StatusCode.ALREADY_EXISTS: ErrorKind.ALREADY_EXISTS,
}
# 400 reads back as INVALID_ARGUMENT, never as ALREADY_EXISTS, which shares it.
_FROM_HTTP: dict[int, ErrorKind] = {s.http: k for k, s in STATUS.items()
                                    if k is not ErrorKind.ALREADY_EXISTS}


def kind_from_grpc(code: grpc.StatusCode) -> ErrorKind:
    return _FROM_GRPC.get(code, ErrorKind.INTERNAL)


def kind_from_http(status: int) -> ErrorKind:
    if status in _FROM_HTTP:
        return _FROM_HTTP[status]
    if status == 408:
        return ErrorKind.DEADLINE_EXCEEDED
    return ErrorKind.INVALID_ARGUMENT if 400 <= status < 500 else ErrorKind.INTERNAL


class ProxyError(Exception):
    """An error with a kind; ``origin`` says who found it (``mmguard`` or ``backend``)."""

    def __init__(self, kind: ErrorKind, message: str, *, origin: str = "mmguard",
                 retry_after_s: float | None = None, status: int | None = None,
                 body: bytes | None = None, param: str | None = None) -> None:
        message = bounded(message)  # the one bound every refusal passes, whoever wrote it
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.origin = origin
        self.retry_after_s = retry_after_s
        # A backend's own HTTP status and error body, returned intact by a front of the same
        # protocol (OpenAI clients parse vLLM's error objects; the status must not change).
        self.status = status
        self.body = body
        self.param = param


def unknown_model(model: str, version: str = "") -> ProxyError:
    """Triton's own refusal of a model (or a version of it) that is not served, word for word:
    clients and Triton's tests match on it. Like Triton's, it lists no models."""
    which = f"'{model}'" + (f" version {version}" if version else "")
    return ProxyError(ErrorKind.NOT_FOUND, f"Request for unknown model: {which} is not found")


def unknown_model_statistics(model: str) -> ProxyError:
    """Triton's answer to statistics of a model it does not serve (400, not 404)."""
    return ProxyError(ErrorKind.INVALID_ARGUMENT, f"requested model '{model}' is not available")


def model_version(version: str) -> str:
    """A client's model version checked as Triton checks it (``std::stol``, then >= 0): ""
    (the latest) or a whole number, given back as its canonical digits; refused with Triton's
    texts otherwise, whichever protocol the backend speaks."""
    if not version:
        return ""
    match = _VERSION.match(version)
    if match is None or not -2**63 <= int(match.group(1)) < 2**63:
        raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                         f"failed to get model version from specified version string "
                         f"'{version}' (details: stol), version should be an integral value > 0")
    number = int(match.group(1))
    if number < 0:
        raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                         f"invalid model version specified '{version}' , version should be an "
                         "integral value > 0")
    return str(number)


_VERSION = re.compile(r"[ \t\n\v\f\r]*([+-]?[0-9]+)")


def retry_after(seconds: float) -> str:
    """The ``Retry-After`` value (header or gRPC trailer) for a wait: whole seconds, at least 1."""
    return str(max(1, round(seconds)))


def cancelled_under() -> bool:
    """Inside ``except asyncio.CancelledError``: True when the cancel is not this task's own
    (a library cancelled what the task awaited, e.g. grpc closing a channel). Let through, it
    ends the call without an answer and the client waits for its deadline; it is an error."""
    task = asyncio.current_task()
    return task is not None and not task.cancelling()
