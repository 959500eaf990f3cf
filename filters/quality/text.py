"""Text quality signals: cheap, reference-free measurements of one text.

Guards against a model answering confidently on garbage text: OCR residue, mojibake, control
characters, a prompt that repeats itself, mixed-script look-alikes ("pаypal" with a Cyrillic 'а').
Each is a ``Signal`` (``signals``). Code points are classified through a table built once
for the Basic Multilingual Plane, so a 1 KB text costs a handful of numpy calls, not a Python
loop per character.
"""

from __future__ import annotations

import unicodedata
from functools import cache

import numpy as np
from numpy.typing import NDArray

from filters.quality.measure import Signal
from filters.quality.measure import ramp as _ramp

TEXT_SIGNALS = ("empty", "length", "control", "replacement", "symbols", "repetition", "script")

# Character classes, one byte per BMP code point.
OTHER, LETTER, DIGIT, SPACE, CONTROL, REPLACEMENT = range(6)
_SPACES = "\t\n\r\x0b\x0c"
_JOINERS = "\u200c\u200d"  # ZWNJ/ZWJ are legitimate in Indic scripts and emoji sequences
_CJK = ("CJK", "HIRAGANA", "KATAKANA", "HANGUL", "BOPOMOFO", "IDEOGRAPHIC", "HALFWIDTH", "YI")
CJK_SCRIPT = 1  # script id of the CJK group: mixing it with Latin inside a token is normal
_NEUTRAL = frozenset(("MICRO", "FEMININE", "MASCULINE", "MODIFIER", "SCRIPT", "BLACK-LETTER",
                      "DOUBLE-STRUCK", "PLANCK", "TURNED", "INFORMATION", "ROMAN", "SMALL"))


def _char_class(ch: str) -> int:
    if ch == "\ufffd":
        return REPLACEMENT
    if ch in _SPACES:
        return SPACE
    cat = unicodedata.category(ch)
    if cat[0] in "LM":
        return LETTER
    if cat[0] == "N":
        return DIGIT
    if cat[0] == "Z":
        return SPACE
    if cat in ("Cc", "Cs", "Co", "Cn") or (cat == "Cf" and ch not in _JOINERS):
        return CONTROL
    return OTHER


def _script_name(ch: str) -> str:
    """The script of a letter from its Unicode name ("" for letter-like symbols: µ, ª, K)."""
    name = unicodedata.name(ch, "")
    if any(name.startswith(p) for p in _CJK):
        return "CJK"
    if "LATIN" in name:
        return "LATIN"
    first = name.split(" ", 1)[0]
    return "" if not first or first in _NEUTRAL or " SIGN" in name else first


@cache
def char_tables() -> tuple[NDArray[np.uint8], NDArray[np.uint8]]:
    """(class, script id) for every BMP code point; built once (~0.1 s), then shared.
    Script ids: 0 = not a letter, 1 = CJK, then one per script in code point order."""
    classes = np.zeros(0x10000, np.uint8)
    scripts = np.zeros(0x10000, np.uint8)
    ids: dict[str, int] = {"CJK": CJK_SCRIPT}
    for cp in range(0x10000):
        ch = chr(cp)
        cls = classes[cp] = _char_class(ch)
        name = _script_name(ch) if cls == LETTER and unicodedata.category(ch)[0] == "L" else ""
        if name:
            scripts[cp] = ids.setdefault(name, min(len(ids) + 1, 253))
    return classes, scripts


def _classify(text: str) -> tuple[NDArray[np.uint8], NDArray[np.uint8]]:
    codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
    table_cls, table_script = char_tables()
    bmp = np.minimum(codes, 0xFFFF)
    cls, script = table_cls[bmp], table_script[bmp]
    astral = np.flatnonzero(codes > 0xFFFF)
    if astral.size:  # emoji and rare scripts: a few per text, classified one by one
        cls = cls.copy()
        script = script.copy()
        for i in astral:
            ch = chr(int(codes[i]))
            cls[i] = _char_class(ch)
            script[i] = 0 if cls[i] != LETTER else 254  # an astral letter: its own script
    return cls, script


def text_signals(text: str, min_chars: int = 1, max_chars: int = 20000) -> dict[str, Signal]:
    """Every text signal of one text. Invalid UTF-8 bytes decoded with ``surrogateescape`` count
    as control characters (they are lone surrogates, class CONTROL)."""
    cls, script = _classify(text)
    counts = np.bincount(cls, minlength=6)
    n = len(text)
    visible = n - int(counts[SPACE])
    share = 1.0 / max(n, 1)
    symbols = int(counts[OTHER]) / max(visible, 1)
    if n < min_chars:
        length = Signal(n / max(min_chars, 1), float(n), f"characters (minimum {min_chars})")
    else:
        length = Signal(min(1.0, max_chars / max(n, 1)), float(n),
                        f"characters (maximum {max_chars})")
    reps = repeated_run(text)
    mixed = mixed_script_share(cls, script)
    return {
        "empty": Signal(1.0 if visible else 0.0, float(visible), "visible characters"),
        "length": length,
        "control": Signal(_ramp(counts[CONTROL] * share, 0.02, 0.0), float(counts[CONTROL]),
                          "control or invalid characters"),
        "replacement": Signal(_ramp(counts[REPLACEMENT] * share, 0.02, 0.0),
                              float(counts[REPLACEMENT]), "U+FFFD replacement characters"),
        "symbols": Signal(_ramp(symbols, 0.5, 0.2), symbols,
                          "share of visible characters that are neither letters nor digits"),
        "repetition": Signal(_ramp(reps, 10.0, 3.0), reps, "repeats of one token sequence"),
        "script": Signal(_ramp(mixed, 0.2, 0.0), mixed, "share of words mixing scripts"),
    }


def repeated_run(text: str, max_period: int = 3) -> float:
    """The most consecutive repeats of one whitespace token or token sequence of up to
    ``max_period`` tokens ("the the the", "ok go ok go ok go"): 1 when nothing repeats."""
    words = text.split()
    if len(words) < 2:
        return 1.0
    index: dict[str, int] = {}
    ids = np.fromiter((index.setdefault(w, len(index)) for w in words), np.int64, len(words))
    best = 1.0
    for p in range(1, min(max_period, len(ids) - 1) + 1):
        same = np.concatenate(([False], ids[p:] == ids[:-p], [False]))
        edges = np.flatnonzero(np.diff(same.astype(np.int8)))
        if edges.size:
            run = int(np.max(edges[1::2] - edges[::2]))
            best = max(best, run / p + 1.0)
    return best


def mixed_script_share(cls: NDArray[np.uint8], script: NDArray[np.uint8]) -> float:
    """Share of words (whitespace-separated, with letters) whose letters come from two or more
    scripts, the CJK group aside: "pаypal" with a Cyrillic 'а' mixes; "Tシャツ" does not count."""
    word = np.cumsum(cls == SPACE)
    keep = (script > 0) & (script != CJK_SCRIPT)
    if not keep.any():
        return 0.0
    w, s = word[keep], script[keep]
    starts = np.flatnonzero(np.concatenate(([True], w[1:] != w[:-1])))
    lo = np.minimum.reduceat(s, starts)
    hi = np.maximum.reduceat(s, starts)
    return float(np.count_nonzero(lo != hi)) / starts.size


