"""Float tensors in a JSON answer written as Triton writes them, byte for byte.

Triton's JSON writer (RapidJSON) prints a double with Grisu2's digits in its own layout:
``2.0``, ``0.000015``, ``1e-7``, ``1.0000000116860974e-7``, ``100000002004087730000.0``;
Python's ``json`` prints the shortest digits in another (``1e-07``, ``1.4999999621068127e-05``,
``1.0000000200408773e+20``). The parsed values are equal, but a client that hashes, caches or
diffs answers saw another answer through mmguard than from Triton whenever mmguard wrote the
JSON itself (a gRPC backend's answer to an HTTP client, a generate answer): about one value in
five near 1e-3 (red team, drop-in round 4).

What MUST hold: an FP32 or FP64 tensor in a JSON answer is the text Triton writes for the same
values (``tests/conformance/test_triton_json_floats.py``: 5,986 random float32 values, none
differing). The C module (``_floats.c``) runs Grisu2 as RapidJSON does (with its scaling of the
last rounding step, which leaves the digits Triton writes a little above Python's shortest
ones for about a quarter of random values); without it (no compiler at install) the same
algorithm runs on Python's integers, ~50x slower, with the same digits.
"""

from __future__ import annotations

import math
import secrets
import struct
from types import ModuleType
from typing import Any

import numpy as np
from numpy.typing import NDArray

native: ModuleType | None
try:
    from proxy.wire import _floats as native
except ImportError:  # not built: no compiler at install, or a source checkout never installed
    native = None

FLOAT_TYPES = frozenset({"FP32", "FP64"})
_MARK = f"\x00mmguard-floats-{secrets.token_hex(8)}-"
"""What stands for a tensor's numbers in the document until they are spliced in: a NUL and a
per-process secret, so no text a client or a backend chose can be taken for it."""
_MARK_JSON = _MARK.replace("\x00", "\\u0000").encode()


def array_text(values: NDArray[Any]) -> bytes:
    """``[v1,v2,...]`` as Triton writes the values (any float dtype; read as doubles)."""
    flat = np.ascontiguousarray(values, dtype=np.float64).reshape(-1)
    if native is not None:
        joined: bytes = native.join(flat)
        return b"[" + joined + b"]"
    return b"[" + b",".join(_one(float(v)) for v in flat) + b"]"


def _one(v: float) -> bytes:
    """One value as ``_floats.c`` writes it (the module's fallback)."""
    if v != v:
        return b"NaN"
    if v in (math.inf, -math.inf):
        return b"Infinity" if v > 0 else b"-Infinity"
    sign = "-" if math.copysign(1.0, v) < 0 else ""
    if v == 0:
        return f"{sign}0.0".encode()
    digits, k = grisu2(abs(v))
    return (sign + lay_out(digits, k)).encode()


_M64 = (1 << 64) - 1
_HIDDEN = 1 << 52


def _power(k: int) -> tuple[int, int]:
    """10^k as a 64-bit significand (rounded to nearest) and its binary exponent."""
    if k >= 0:
        v = 10 ** k
        e = v.bit_length() - 64
        if e <= 0:
            return v << -e, e
        q, r = divmod(v, 1 << e)
        q += 2 * r >= 1 << e
    else:
        d = 10 ** -k
        s = 63 + d.bit_length()
        q, r = divmod(1 << s, d)
        if q >> 64:
            s -= 1
            q, r = divmod(1 << s, d)
        q += 2 * r >= d
        e = -s
    return (q >> 1, e + 1) if q >> 64 else (q, e)


def _times(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    p = a[0] * b[0]
    return (p >> 64) + ((p >> 63) & 1), a[1] + b[1] + 64


def _normal(f: int, e: int) -> tuple[int, int]:
    s = 64 - f.bit_length()
    return f << s, e - s


def grisu2(value: float) -> tuple[str, int]:
    """The digits RapidJSON's Grisu2 gives a finite positive double, and their exponent
    (value = int(digits) * 10^k): ``_floats.c``'s algorithm on Python's integers."""
    bits = struct.unpack("<Q", struct.pack("<d", value))[0]
    biased, mantissa = bits >> 52 & 0x7FF, bits & (_HIDDEN - 1)
    f, e = (mantissa + _HIDDEN, biased - 1075) if biased else (mantissa, -1074)
    plus = _normal((f << 1) + 1, e - 1)
    low_f, low_e = ((f << 2) - 1, e - 2) if f == _HIDDEN else ((f << 1) - 1, e - 1)
    minus = (low_f << (low_e - plus[1]), plus[1])
    dk = (-61 - plus[1]) * 0.30102999566398114 + 347
    ki = int(dk) + (dk - int(dk) > 0.0)
    index = (ki >> 3) + 1
    k = -(-348 + (index << 3))
    c = _power(-348 + (index << 3))
    w = _times(_normal(f, e), c)
    wp = _times(plus, c)
    wm = _times(minus, c)
    mp = (wp[0] - 1, wp[1])
    delta = mp[0] - (wm[0] + 1)
    return _digits(w, mp, delta, k)


def _digits(w: tuple[int, int], mp: tuple[int, int], delta: int, k: int) -> tuple[str, int]:
    shift = -mp[1]
    one = 1 << shift
    wp_w = mp[0] - w[0]
    p1, p2 = mp[0] >> shift, mp[0] & (one - 1)
    out: list[int] = []
    kappa = len(str(p1))
    while kappa > 0:
        d, p1 = divmod(p1, 10 ** (kappa - 1))
        if d or out:
            out.append(d)
        kappa -= 1
        rest = (p1 << shift) + p2
        if rest <= delta:
            return _nudged(out, delta, rest, 10 ** kappa << shift, wp_w), k + kappa
    while True:
        p2 *= 10
        delta *= 10
        d = p2 >> shift
        if d or out:
            out.append(d)
        p2 &= one - 1
        kappa -= 1
        if p2 < delta:
            scale = 10 ** -kappa if -kappa < 9 else 0  # as RapidJSON scales it (_floats.c)
            return _nudged(out, delta, p2, one, (wp_w * scale) & _M64), k + kappa


def _nudged(out: list[int], delta: int, rest: int, ten_kappa: int, wp_w: int) -> str:
    while (rest < wp_w and delta - rest >= ten_kappa
           and (rest + ten_kappa < wp_w or wp_w - rest > rest + ten_kappa - wp_w)):
        out[-1] -= 1
        rest += ten_kappa
    return "".join(map(str, out))


def lay_out(digits: str, k: int) -> str:
    """RapidJSON's layout of ``digits`` × 10^k (the same rules as ``_floats.c``)."""
    n = len(digits)
    kk = n + k
    if k >= 0 and kk <= 21:
        return digits + "0" * k + ".0"
    if 0 < kk <= 21:
        return digits[:kk] + "." + digits[kk:]
    if -6 < kk <= 0:
        return "0." + "0" * -kk + digits
    if n == 1:
        return f"{digits}e{kk - 1}"
    return f"{digits[0]}.{digits[1:]}e{kk - 1}"


class Spliced:
    """Float tensors' texts made apart and spliced into the JSON document that holds them."""

    def __init__(self) -> None:
        self.texts: list[bytes] = []

    def stand_in(self, values: NDArray[Any], alone: bool = False) -> str:
        """What to put in the document where ``values`` go (``alone``: one value, written as
        itself, not as an array of one)."""
        text = array_text(values)
        self.texts.append(text[1:-1] if alone else text)
        return f"{_MARK}{len(self.texts) - 1}\x00"

    def into(self, document: bytes) -> bytes:
        """``document`` (as ``json_bytes`` wrote it) with each stand-in replaced."""
        if not self.texts:
            return document
        parts = document.split(b'"' + _MARK_JSON)
        out = [parts[0]]
        for part in parts[1:]:
            index, _, rest = part.partition(b"\\u0000\"")
            out += [self.texts[int(index)], rest]
        return b"".join(out)
