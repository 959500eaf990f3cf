"""BYTES framing is checked at a cost bounded by the shape (numpy for equal-length elements, a
walk that stops past the shape's count otherwise), and every error message is bounded."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.call import LocalReply
from proxy.errors import MAX_MESSAGE_CHARS, ErrorKind, ProxyError, bounded, name_list
from proxy.tensor import (
    MAX_RANK,
    Tensor,
    check_bytes_elements,
    decode_bytes_elements,
    encode_bytes_elements,
)

elements = st.lists(st.binary(max_size=12), max_size=20)


@given(elements)
def test_framed_elements_split_back(items: list[bytes]) -> None:
    raw = encode_bytes_elements(items)
    check_bytes_elements(raw, len(items), "x")
    assert decode_bytes_elements(raw, len(items), "x") == items
    assert decode_bytes_elements(memoryview(raw), len(items), "x") == items


@given(st.binary(max_size=6), st.integers(1, 30))
def test_equal_length_elements_split_back_with_their_zero_bytes(item: bytes, n: int) -> None:
    items = [item + b"\0"] * n  # numpy's S dtype would strip the trailing zero; V keeps it
    assert decode_bytes_elements(encode_bytes_elements(items), n) == items


@given(elements, st.integers(0, 3))
def test_a_count_other_than_the_shape_is_refused(items: list[bytes], extra: int) -> None:
    raw = encode_bytes_elements(items)
    for count in {len(items) + 1 + extra, max(0, len(items) - 1 - extra)} - {len(items)}:
        with pytest.raises(ProxyError, match="input 'x': ") as err:
            check_bytes_elements(raw, count, "x")
        assert err.value.kind is ErrorKind.INVALID_ARGUMENT
        assert f"shape needs {count} BYTES elements" in err.value.message


def test_millions_of_empty_elements_for_a_shape_of_one_stop_at_the_second() -> None:
    raw = b"\0" * (4 * 4_000_000)
    t0 = time.monotonic()
    with pytest.raises(ProxyError) as err:
        check_bytes_elements(raw, 1, "text")
    # The message proves where the walk stopped: right after the shape's only element.
    assert err.value.message == ("input 'text': shape needs 1 BYTES elements, got more: "
                                 f"{len(raw) - 4} bytes follow element 0")
    mixed = b"\0\0\0\0\1\0\0\0x" * 2_000_000  # no equal-length shortcut
    with pytest.raises(ProxyError, match="got more: 17999987 bytes follow element 2"):
        check_bytes_elements(mixed, 3, "text")
    assert time.monotonic() - t0 < 1.0  # generous: it is microseconds; the old loop took seconds


def test_millions_of_equal_elements_are_checked_and_split_by_numpy() -> None:
    n = 2_000_000
    check_bytes_elements(b"\0" * (4 * n), n)
    assert decode_bytes_elements(b"\0" * (4 * n), n) == [b""] * n
    raw = b"\2\0\0\0ab" * n
    items = decode_bytes_elements(raw, n)
    assert len(items) == n and items[0] == items[-1] == b"ab"
    with pytest.raises(ProxyError, match="element 1999999 declares 2 bytes, only 1 remain"):
        check_bytes_elements(raw[:-1], n)


@pytest.mark.parametrize("raw,count,says", [
    (b"\0\0", 1, "shape needs 1 BYTES elements (at least 4 bytes of length prefixes), got 2 "
                 "bytes"),
    (b"\0\0\0\0\0\0", 1, "shape needs 1 BYTES elements, got more: 2 bytes follow element 0"),
    (b"\5\0\0\0abcde\0\0", 2, "BYTES element 1 has a cut length prefix"),
    (b"\x10\0\0\0abc", 1, "BYTES element 0 declares 16 bytes, only 3 remain"),
    (b"\0\0\0\0", 0, "shape needs 0 BYTES elements, got 4 bytes"),
    (b"\1\0\0\0a\1\0\0\0b", 3, "shape needs 3 BYTES elements (at least 12 bytes"),
    (b"\1\0\0\0a\1\0\0\0b\0\0\0\0", 4, "shape needs 4 BYTES elements (at least 16"),
    (b"\0\0\0\0\1\0\0\0a\0\0\0\0\0\0\0\0", 3,
     "shape needs 3 BYTES elements, got more: 4 bytes follow element 2"),
])
def test_broken_framing_says_what_and_where(raw: bytes, count: int, says: str) -> None:
    with pytest.raises(ProxyError) as err:
        decode_bytes_elements(raw, count, "x")
    assert err.value.kind is ErrorKind.INVALID_ARGUMENT
    assert err.value.message.startswith("input 'x': ") and says in err.value.message


def test_bytes_tensor_numpy_view_and_payload_check() -> None:
    t = Tensor("x", "BYTES", (2, 2), raw=encode_bytes_elements([b"a", b"bb", b"", b"c"]))
    t.check_payload()
    assert t.numpy().tolist() == [[b"a", b"bb"], [b"", b"c"]]
    bad = Tensor("x", "BYTES", (3,), raw=b"\0" * 40)
    with pytest.raises(ProxyError, match="got more: 28 bytes follow element 2"):
        bad.check_payload()


def test_rank_past_the_bound_is_refused() -> None:
    with pytest.raises(ProxyError, match=f"shape has {MAX_RANK + 1} dims; mmguard takes at "
                                         f"most {MAX_RANK}"):
        Tensor("x", "FP32", (1,) * (MAX_RANK + 1), raw=b"\0" * 4).check_payload()


# --- bounded messages ----------------------------------------------------------------------------


def test_bounded_keeps_short_text_and_cuts_long_text_saying_how_much() -> None:
    assert bounded("short") == "short"
    long = "x" * 5000
    cut = bounded(long)
    assert len(cut) == MAX_MESSAGE_CHARS
    assert cut.endswith(f" ... [cut: {5000 - MAX_MESSAGE_CHARS} more characters]")
    assert bounded(long, 100).startswith("x" * 50) and len(bounded(long, 100)) == 100


def test_name_list_shows_the_first_names_and_counts_the_rest() -> None:
    assert name_list(["a", "b"]) == "['a', 'b']"
    assert name_list([f"in{i}" for i in range(100_000)]) == (
        "['in0', 'in1', 'in2', 'in3', 'in4', ... and 99995 more]")


def test_every_refusal_is_bounded_whoever_builds_it() -> None:
    names = [f"unknown_{i}" for i in range(100_000)]
    err = ProxyError(ErrorKind.INVALID_ARGUMENT, f"unknown inputs: {names}")
    assert len(err.message) == len(str(err)) == MAX_MESSAGE_CHARS
    assert err.message.startswith("unknown inputs: ['unknown_0', 'unknown_1'")
    assert len(LocalReply(ErrorKind.INVALID_ARGUMENT, "y" * 10**6).message) == MAX_MESSAGE_CHARS
    assert LocalReply.from_error(err).message == err.message


def test_bytes_elements_from_numpy_round_trip() -> None:
    arr = np.array([b"x", b"", b"yz"], dtype=object)
    t = Tensor.from_numpy("s", arr)
    assert t.datatype == "BYTES" and t.numpy().tolist() == [b"x", b"", b"yz"]


def test_decision_header_values_are_bounded() -> None:
    from proxy.call import Call
    from proxy.errors import MAX_HEADER_CHARS
    from proxy.telemetry import Telemetry

    call = Call(model="m", version="", inputs=[])
    detail = "; ".join(f"no input 'in{i}'" for i in range(10**4))
    Telemetry().decide(call, "shape", "reject", detail, header="unknown-input")
    value = call.decisions["mmguard-shape-unknown-input"]
    assert len(value) == MAX_HEADER_CHARS
    assert value.startswith("reject; no input 'in0'; no input 'in1'")
    assert value.endswith(" more characters]")


def test_header_values_are_printable_ascii() -> None:
    from proxy.errors import header_value

    assert header_value("reject; 6300×6300 image\n") == "reject; 6300\\xd76300 image\\x0a"
    assert header_value("plain; ok") == "plain; ok"


def test_name_list_cuts_long_names() -> None:
    assert name_list(["n" * 100]) == "['" + "n" * 61 + "...']"
