"""Generic ways to break an input, shared by the decoders' strategies: byte-level mutations of a
valid encoding, JSON values of every kind, and JSON texts that are legal-looking but hostile
(deep nesting, NaN/Infinity literals, duplicated keys, non-UTF-8, numbers too big to hold)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

# Values that sit on the edges of the integer types a decoder converts to.
EDGE_INTS = [0, 1, -1, 2**7, 2**8, 2**15, 2**16, 2**31 - 1, 2**31, 2**32, 2**53 + 1,
             2**62, 2**63 - 1, 2**63, 2**64, -(2**63), -(2**63) - 1, 10**30]
EDGE_FLOATS = [0.0, -0.0, 1.5, 1e308, -1e308, 5e-324, float("nan"), float("inf"),
               float("-inf"), 65504.0, 65520.0, 3.4028235e38, 3.5e38]


def edge_ints() -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from(EDGE_INTS), st.integers())


def json_scalars() -> st.SearchStrategy[Any]:
    return st.one_of(st.none(), st.booleans(), edge_ints(), st.sampled_from(EDGE_FLOATS),
                     st.floats(), st.text(max_size=12))


def json_values(max_leaves: int = 12) -> st.SearchStrategy[Any]:
    return st.recursive(
        json_scalars(),
        lambda inner: st.one_of(st.lists(inner, max_size=4),
                                st.dictionaries(st.text(max_size=8), inner, max_size=4)),
        max_leaves=max_leaves)


@st.composite
def mutated_bytes(draw: st.DrawFn, data: bytes, max_ops: int = 3) -> bytes:
    """``data`` with up to ``max_ops`` cuts, flips, insertions, deletions or duplications."""
    out = bytearray(data)
    for _ in range(draw(st.integers(0, max_ops))):
        pos = draw(st.integers(0, len(out)))
        op = draw(st.sampled_from(["cut", "flip", "insert", "delete", "duplicate"]))
        if op == "cut":
            del out[pos:]
        elif op == "flip" and pos < len(out):
            out[pos] ^= draw(st.integers(1, 255))
        elif op == "insert":
            out[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del out[pos:pos + draw(st.integers(1, 8))]
        elif op == "duplicate":
            out[pos:pos] = out[pos:pos + draw(st.integers(1, 16))]
    return bytes(out)


def dumps(doc: Any) -> bytes:
    """JSON as a client library writes it; NaN and Infinity come out as bare literals."""
    return json.dumps(doc, allow_nan=True).encode()


@st.composite
def hostile_json(draw: st.DrawFn, doc: dict[str, Any]) -> bytes:
    """``doc`` encoded, then made hostile in one of the ways a JSON parser is attacked."""
    text = dumps(doc)
    way = draw(st.sampled_from(["deep", "deep_inside", "literals", "duplicate", "non_utf8",
                                "utf16", "bom", "huge_number", "long_number", "surrogate",
                                "trailing", "control"]))
    depth = draw(st.sampled_from([64, 1_000, 3_000, 10_000]))  # Python's limit is ~1,000
    if way == "deep":
        return b"[" * depth + b"]" * draw(st.sampled_from([0, depth]))
    if way == "deep_inside":  # a deep value where a decoder looks: the first key's value
        key = next(iter(doc), "k")
        return b'{"' + key.encode() + b'": ' + b"[" * depth + b"]" * depth + b"}"
    if way == "literals":
        literal = draw(st.sampled_from([b"NaN", b"Infinity", b"-Infinity"]))
        return text.replace(b"1", literal, 1) if b"1" in text else text[:-1] + b',"x":NaN}'
    if way == "duplicate":
        key = next(iter(doc), "k")
        return text[:-1] + b', "' + key.encode() + b'": ' + dumps(draw(json_values(4))) + b"}"
    if way == "non_utf8":
        pos = draw(st.integers(0, len(text)))
        return text[:pos] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80"])) + text[pos:]
    if way == "utf16":
        return text.decode().encode(draw(st.sampled_from(["utf-16", "utf-16-le", "utf-32"])))
    if way == "bom":
        return b"\xef\xbb\xbf" + text
    if way == "huge_number":
        return text[:-1] + b', "n": 1e999}'
    if way == "long_number":
        return text[:-1] + b', "n": ' + b"9" * draw(st.sampled_from([4_300, 4_301, 12_000])) + b"}"
    if way == "surrogate":
        return text.replace(b'"', b'"\\ud800', 1)
    if way == "trailing":
        return text + draw(st.sampled_from([b" ", b"\n{}", b",", b"\x00"]))
    return text.replace(b'"', b'"\x01\n', 1)
