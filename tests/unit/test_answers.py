"""``proxy.wire.answers``: the length checks every backend answer goes through."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from proxy.errors import ErrorKind, ProxyError
from proxy.tensor import Tensor, encode_bytes_elements
from proxy.wire.answers import check_outputs, output_problem


def test_fitting_outputs_pass() -> None:
    fp = np.zeros((2, 3), np.float32).tobytes()
    assert output_problem("y", "FP32", (2, 3), memoryview(fp)) is None
    assert output_problem("y", "BF16", (4,), bytes(8)) is None
    assert output_problem("y", "BYTES", (3,), encode_bytes_elements([b"", b"\0", b"ab"])) is None
    assert output_problem("y", "BYTES", (0,), b"") is None
    assert output_problem("y", "FP32", (2, 2), None, [[1.0, 2.0], [3.0, 4.0]]) is None


@pytest.mark.parametrize(("args", "expected"), [
    (("FP32", (4,), bytes(12)), "FP32 shape [4] needs 16 bytes, got 12"),
    (("INT64", (1, 2), bytes(24)), "INT64 shape [1, 2] needs 16 bytes, got 24"),
    (("FP32", (-1,), b""), "negative dim"),
    (("FP99", (1,), bytes(4)), "unknown datatype 'FP99'"),
    (("BYTES", (2,), encode_bytes_elements([b"abcd"])), "needs 2 BYTES elements, got 1"),
    (("BYTES", (1,), encode_bytes_elements([b"a", b"b"])), "needs 1 BYTES elements, got more"),
    (("BYTES", (1,), struct.pack("<I", 5) + b"abc"), "declares 5 bytes, only 3 remain"),
    (("BYTES", (2,), encode_bytes_elements([b"abc"]) + b"\x01\x00"), "cut length prefix"),
    (("BYTES", (4,), bytes(12)), "at least 16 bytes of length prefixes"),
])
def test_outputs_that_do_not_fit(args: tuple[str, tuple[int, ...], bytes], expected: str) -> None:
    problem = output_problem("y", *args)
    assert problem is not None and expected in problem and "output 'y'" in problem


def test_json_data_count() -> None:
    problem = output_problem("y", "INT32", (2, 2), None, [[1, 2], [3]])
    assert problem is not None and "needs 4 elements, the JSON data has 3" in problem


def test_check_outputs_is_a_bad_gateway_from_the_backend() -> None:
    bad = Tensor("y", "FP32", (2,), raw=bytes(4))
    with pytest.raises(ProxyError) as err:
        check_outputs([Tensor("x", "FP32", (1,), raw=bytes(4)), bad],
                      "backend 'b' for model 'm'")
    assert err.value.kind is ErrorKind.BAD_GATEWAY and err.value.origin == "backend"
    assert err.value.message == ("backend 'b' for model 'm' answered outside its contract: "
                                 "output 'y': FP32 shape [2] needs 8 bytes, got 4")


def test_grpc_answer_in_typed_contents_is_read_and_checked() -> None:
    """KServe servers other than Triton may answer in typed ``contents``; they are counted too."""
    from proxy.pb import grpc_service_pb2 as pb
    from proxy.wire import kserve_grpc

    resp = pb.ModelInferResponse(model_name="m")
    out = resp.outputs.add(name="y", datatype="FP32", shape=[3])
    out.contents.fp32_contents.extend([1.0, 2.0, 3.0])
    result = kserve_grpc.decode_response(resp.SerializeToString(), "backend 'b' for model 'm'")
    assert result.outputs[0].numpy().tolist() == [1.0, 2.0, 3.0]
    out.contents.fp32_contents.append(4.0)
    with pytest.raises(ProxyError) as err:
        kserve_grpc.decode_response(resp.SerializeToString(), "backend 'b' for model 'm'")
    assert ("answered outside its contract: output 'y': shape [3] needs 3 FP32 elements, "
            "fp32_contents holds 4") in err.value.message


def test_a_cut_decision_detail_is_still_a_valid_grpc_trailer() -> None:
    """A long reason cut for a header must stay ASCII: grpc refuses a trailer with any other
    character and turns the whole answer into INTERNAL "Invalid metadata"."""
    from proxy.errors import MAX_HEADER_CHARS, bounded, name_list

    cut = bounded("x" * 1000, MAX_HEADER_CHARS)
    assert len(cut) <= MAX_HEADER_CHARS and cut.isascii() and "cut: " in cut
    assert name_list([f"m{i}" for i in range(9)]).isascii()
