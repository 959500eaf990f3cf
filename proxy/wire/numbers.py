"""Numbers a client sends, parsed so that every oversized or malformed one is a 400.

Seed scenario (issue 26): ``Inference-Header-Content-Length`` of 4301+ digits got a 500 and a
traceback: ``str.isdigit()`` let it through and ``int()`` refused it past Python's limit on
digits (``sys.get_int_max_str_digits()``, 4300), outside any ``try``. The same limit makes
``json.loads`` refuse a 5000-digit number with a message that names a Python setting.

Rules that MUST hold, on every front:
- A count in a header (a length, a size) is ASCII digits only — not ``+5``, `` 5``, ``5_0``
  nor other scripts' digits, all of which ``int()`` takes — and at most ``MAX_COUNT_DIGITS``
  long; anything else is ``INVALID_ARGUMENT`` naming the header, what was expected, what came.
- JSON bodies parse through ``json_loads``: a number past the digit limit is a ``ValueError``
  that says so in words; nesting past the interpreter's recursion limit stays a
  ``RecursionError`` (each caller names its body).
- A key repeated in one JSON object means what it means to the backend the body is for: the
  KServe v2 bodies read the **first** (``first_wins``: Triton's parser, rapidjson, finds the
  first), the OpenAI ones the last (vLLM's, Python's ``json``). mmguard forwards a body it did
  not change as its bytes, so a filter that read another key than the backend's would judge
  one request and let another through (``{"inputs": [batch 8], "inputs": [batch 1]}``
  passed ``limits.max_batch: 1``, and Triton ran batch 8).
"""

from __future__ import annotations

import json
import math
import re
import sys
from typing import Any

from proxy.errors import ErrorKind, ProxyError

MAX_COUNT_DIGITS = 19
"""Digits of the largest count a header may carry (int64 has 19)."""

_DIGITS = re.compile(r"value has (\d+) digits")


def header_count(name: str, value: str) -> int:
    """``value`` of header ``name`` as a non-negative integer; ProxyError INVALID_ARGUMENT
    otherwise (the value shown cut to 40 characters)."""
    if value.isascii() and value.isdigit() and len(value) <= MAX_COUNT_DIGITS:
        return int(value)
    raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                     f"{name} must be a non-negative integer of at most {MAX_COUNT_DIGITS} "
                     f"ASCII digits, got {shown_value(value)}")


def shown_value(value: str) -> str:
    """A client's value as an error shows it: at most 40 characters, and how long it was."""
    return repr(value[:40]) + (f" ... ({len(value)} characters)" if len(value) > 40 else "")


def _first_wins(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        out.setdefault(key, value)
    return out


class NumberTooBig(ValueError):
    """A number literal past the double range: rapidjson (Triton's parser) refuses it, where
    Python's ``json`` reads ``1E400`` as infinity (``NaN`` and ``Infinity`` both take)."""

    def __init__(self) -> None:
        super().__init__("Number too big to be stored in double. (a number literal is past "
                         "the range of a double)")


_DIGITS_AS_ZERO = bytes.maketrans(b"123456789E-", b"000000000e+")
_EXPONENT_OF_3 = re.compile(rb"e\+?000")
_RUN_OF_309 = b"0" * 309
_CHUNK = 1 << 20


def _maybe_past_double(data: bytes | bytearray | str) -> bool:
    """Whether ``data`` has what a literal past the double range needs (an exponent of three
    digits, or 309 digits in a row): a body without it is parsed with ``json``'s fast paths
    only. Read with digits as ``0`` a chunk at a time (a regex over the body itself took more
    than the parse)."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    for start in range(0, len(raw), _CHUNK):
        part = raw[start:start + _CHUNK + len(_RUN_OF_309)].translate(_DIGITS_AS_ZERO)
        if _EXPONENT_OF_3.search(part) is not None or _RUN_OF_309 in part:
            return True
    return False


def _double(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise NumberTooBig
    return value


def _int_in_double(text: str) -> int:
    value = int(text)
    if len(text) > 308:
        try:
            float(value)
        except OverflowError:
            raise NumberTooBig from None
    return value


def json_loads(data: bytes | bytearray | str, first_wins: bool = False) -> Any:
    """``json.loads``; a number with more digits than Python converts is a ValueError saying
    so (not naming an interpreter setting). RecursionError passes through. ``first_wins``: read
    as Triton's parser reads it: a key repeated in an object keeps its first value, not its
    last, and a number literal past the double range is ``NumberTooBig``."""
    try:
        if not first_wins:
            return json.loads(data)
        if not _maybe_past_double(data):
            return json.loads(data, object_pairs_hook=_first_wins)
        return json.loads(data, object_pairs_hook=_first_wins, parse_float=_double,
                          parse_int=_int_in_double)
    except (UnicodeDecodeError, NumberTooBig):
        raise
    except ValueError as exc:
        found = _DIGITS.search(str(exc))
        if found is None:
            raise
        raise ValueError(f"a number has {found[1]} digits; numbers have at most "
                         f"{sys.get_int_max_str_digits()} digits") from None
