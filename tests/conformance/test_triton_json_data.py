"""KServe v2 JSON ``data`` read as Triton reads it, direct and through mmguard (both Triton
backends): any nesting is flattened and only the element count is held to the shape (ragged
rows and empty ones included), a double past float32's range is ±inf in an FP32 input (Triton's
cast), and a literal past the double range is refused by the JSON parser (Python's ``json``
reads ``1E400`` as infinity, so mmguard answered 200 where Triton refuses).
"""

from __future__ import annotations

import json
import math

import pytest

from tests.conformance.conftest import Target
from tests.support.wire import http_post

INF = math.inf
ACCEPTED: dict[str, tuple[str, str, list[int], str, list[object]]] = {
    # case: (model, datatype, shape, data as sent, the output's data)
    "ragged": ("identity_fp32", "FP32", [1, 3], "[[1,2],[3]]", [1.0, 2.0, 3.0]),
    "empty-row-first": ("identity_fp32", "FP32", [1, 2], "[[],[1,2]]", [1.0, 2.0]),
    "empty-row-last": ("identity_fp32", "FP32", [1, 2], "[[1,2],[]]", [1.0, 2.0]),
    "deeper-first": ("identity_fp32", "FP32", [1, 2], "[[[1]],2]", [1.0, 2.0]),
    "rows-for-columns": ("identity_fp32", "FP32", [1, 2], "[[1],[2]]", [1.0, 2.0]),
    "past-float32": ("identity_fp32", "FP32", [1, 2], "[1e39,-1e39]", [INF, -INF]),
    "rounds-past-float32": ("identity_fp32", "FP32", [1, 2], "[3.4028235677973366e38,1]",
                            [INF, 1.0]),
    "int64-ragged": ("identity_int64", "INT64", [1, 3], "[[1],[2,3]]", [1, 2, 3]),
    "bytes-ragged": ("identity_bytes", "BYTES", [1, 2], '[["a"],[[],"b"]]', ["a", "b"]),
    "bool-ragged": ("identity_bool", "BOOL", [1, 2], "[[true],[[false]]]", [True, False]),
}
TOO_BIG = "failed to parse the request JSON buffer: Number too big to be stored in double."
REFUSED = {  # case: the body's text
    "exponent-past-double": '{"inputs":[{"name":"INPUT0","datatype":"FP32","shape":[1,2],'
                            '"data":[1E400,1]}]}',
    "negative-past-double": '{"inputs":[{"name":"INPUT0","datatype":"FP32","shape":[1,2],'
                            '"data":[-1e+400,1]}]}',
    "integer-past-double": '{"inputs":[{"name":"INPUT0","datatype":"FP32","shape":[1,2],'
                           '"data":[1' + "0" * 400 + ",1]}]}",
    "parameter-past-double": '{"inputs":[{"name":"INPUT0","datatype":"FP32","shape":[1,2],'
                             '"data":[1,2]}],"parameters":{"p":1E400}}',
}


def _doc(datatype: str, shape: list[int], data: str) -> bytes:
    return (f'{{"inputs":[{{"name":"INPUT0","datatype":"{datatype}","shape":{shape},'
            f'"data":{data}}}]}}').encode()


@pytest.mark.parametrize("case", list(ACCEPTED))
def test_json_data_triton_accepts(target: Target, case: str) -> None:
    model, datatype, shape, data, want = ACCEPTED[case]
    status, _, body = http_post(target.http_url, f"/v2/models/{model}/infer",
                                _doc(datatype, shape, data))
    assert status == 200, body
    out = json.loads(body)["outputs"][0]
    assert out["shape"] == shape and out["data"] == want, out


@pytest.mark.parametrize("case", list(REFUSED))
def test_json_number_past_double_refused(target: Target, case: str) -> None:
    status, _, body = http_post(target.http_url, "/v2/models/identity_fp32/infer",
                                REFUSED[case].encode())
    # Triton's JSON parser errors are 500; mmguard's 400 (docs/triton-compat.md)
    assert status == (400 if target.via_mmguard else 500), body
    assert json.loads(body)["error"].startswith(TOO_BIG), body


def test_json_nan_and_infinity_literals_taken(target: Target) -> None:
    status, _, body = http_post(target.http_url, "/v2/models/identity_fp32/infer",
                                _doc("FP32", [1, 3], "[NaN,Infinity,-Infinity]"))
    assert status == 200, body
    data = json.loads(body)["outputs"][0]["data"]
    assert math.isnan(data[0]) and data[1:] == [INF, -INF], data
