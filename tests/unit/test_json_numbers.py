"""``json_loads`` as Triton's parser reads numbers: a literal past the double range is refused
wherever it lies in the body (a chunk's edge included), ``NaN`` / ``Infinity`` and everything
else read as ``json`` reads them."""

from __future__ import annotations

import math

import pytest

from proxy.wire.numbers import _CHUNK, NumberTooBig, json_loads


@pytest.mark.parametrize("literal", ["1E400", "-1e+400", "9e308", "1" + "0" * 309,
                                     "-" + "9" * 400])
@pytest.mark.parametrize("at", [0, _CHUNK - 3, _CHUNK - 200, 2 * _CHUNK + 5])
def test_past_double_refused_anywhere(literal: str, at: int) -> None:
    pad = " " * at
    with pytest.raises(NumberTooBig):
        json_loads(f'{{"a":{pad}[1,{literal}]}}'.encode(), first_wins=True)


@pytest.mark.parametrize("text,value", [("1e308", 1e308), ("0.1e309", 1e308), ("1e-400", 0.0),
                                        ('"e400"', "e400"), ("1" + "0" * 308, 10**308)])
def test_within_double_read_as_json_reads_it(text: str, value: object) -> None:
    assert json_loads(f"[{text}]".encode(), first_wins=True) == [value]


def test_nan_and_infinity_literals_and_the_other_mode() -> None:
    nan, inf = json_loads(b"[NaN,Infinity]", first_wins=True)
    assert math.isnan(nan) and inf == math.inf
    assert json_loads(b"[1E400]") == [math.inf]  # the OpenAI bodies: as vLLM's json reads them
