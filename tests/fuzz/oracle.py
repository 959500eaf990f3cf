"""The property every wire decoder MUST satisfy, as plain functions that raise AssertionError.

A decoder given any input either returns a value or raises ``ProxyError`` whose kind is a client
error (a 4xx HTTP status) with a non-empty message; never any other exception. A value it returns
MUST be usable: every tensor of an accepted call can be viewed in its declared shape (what the
ONNX Runtime backend and the filters do next), so "accepted" never means "crashes later".

Two kinds of warning are errors inside a decoder call: numpy's DeprecationWarning when it wraps
an out-of-range integer (a silent wrong value in production; numpy 2 raises instead) and PIL's
DecompressionBombWarning (a small file about to become a huge array). Others are left alone: PIL
warns about a corrupt file just before it raises the OSError that the decoder turns into a 400.

Used by ``tests/fuzz/test_decoders.py`` and ``scripts/fuzz_long.py``. ``refuses`` is the
stricter form for a regression test: the input MUST be refused, with the kind and the message
fragments the test names (so a decoder that accepts everything, or refuses with a vague message,
fails it).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from proxy.call import Call
from proxy.errors import STATUS, ErrorKind, ProxyError

T = TypeVar("T")

CLIENT_ERRORS = frozenset(k for k, s in STATUS.items() if 400 <= s.http < 500)
"""Kinds a refusal of bad input may have: INVALID_ARGUMENT, UNPROCESSABLE, TOO_LARGE, …"""


def check_refusal(err: ProxyError) -> None:
    # UNIMPLEMENTED (501) is allowed for one feature only: shared-memory tensors, which a client
    # may legitimately use with Triton and mmguard declines by design.
    if err.kind is ErrorKind.UNIMPLEMENTED:
        assert "shared memory" in err.message, err.message
    else:
        assert err.kind in CLIENT_ERRORS, (
            f"refused with {err.kind.name} (HTTP {STATUS[err.kind].http}): {err.message}")
    assert err.message.strip(), f"refused with {err.kind.name} and an empty message"


@contextlib.contextmanager
def _fatal_warnings() -> Iterator[None]:
    from PIL.Image import DecompressionBombWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warnings.simplefilter("error", DeprecationWarning)
        warnings.simplefilter("error", DecompressionBombWarning)
        yield


def decodes_or_refuses(decode: Callable[..., T], *args: Any) -> T | None:
    """``decode(*args)``, or None when it refused properly. Anything else propagates."""
    try:
        with _fatal_warnings():
            return decode(*args)
    except ProxyError as err:
        check_refusal(err)
        return None


def check_call_usable(call: Call) -> None:
    """Every input of an accepted call has a consistent payload and a numpy view of its shape."""
    for t in call.inputs:
        t.check_payload()
        with _fatal_warnings():
            arr = t.numpy()
        assert arr.shape == t.shape, (t.name, arr.shape, t.shape)


def refuses(decode: Callable[..., object], *args: Any,
            kind: ErrorKind = ErrorKind.INVALID_ARGUMENT, says: Sequence[str]) -> ProxyError:
    """``decode(*args)`` MUST raise a ``ProxyError`` of ``kind`` whose message holds every one of
    ``says`` (what the input is, what was expected, what came); the refusal is returned."""
    assert says, "a refusal test names what the message must say"
    try:
        with _fatal_warnings():
            value = decode(*args)
    except ProxyError as err:
        check_refusal(err)
        assert err.kind is kind, f"refused with {err.kind.name}, not {kind.name}: {err.message}"
        missing = [s for s in says if s not in err.message]
        assert not missing, f"the message {err.message!r} does not say {missing}"
        return err
    raise AssertionError(f"accepted instead of refused ({kind.name}): {value!r:.300}")
