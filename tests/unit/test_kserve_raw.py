"""The raw binary form read as Triton reads it: shapes deduced from the model's one input,
BYTES framed, the header length read as C's atoi reads it, and Triton's texts on refusal."""

from __future__ import annotations

import pytest

from proxy.contract import ModelContract, TensorSpec
from proxy.errors import ErrorKind, ProxyError
from proxy.wire.kserve_raw import decode_raw_request, header_length_value, is_raw


def _model(*inputs: TensorSpec, batch: int = 0) -> ModelContract:
    return ModelContract("m", ("1",), "onnxruntime", inputs,
                         (TensorSpec("y", "FP32", (-1,)),), max_batch_size=batch)


def _refused(contract: ModelContract, body: bytes) -> str:
    with pytest.raises(ProxyError) as err:
        decode_raw_request(body, "m", "", contract)
    assert err.value.kind is ErrorKind.INVALID_ARGUMENT
    return err.value.message


@pytest.mark.parametrize("dims,batch,body_len,shape", [
    ((-1, 16), 8, 64, (1, 16)),  # batching: a batch of one in front of the config dims
    ((16,), 0, 64, (16,)),
    ((-1,), 0, 12, (3,)),  # the one variable dim sized by the body
    ((-1, -1), 8, 12, (1, 3)),  # the batch dim is not a variable config dim
    ((2, -1), 0, 24, (2, 3)),
])
def test_shapes_are_deduced_from_the_model(dims: tuple[int, ...], batch: int, body_len: int,
                                          shape: tuple[int, ...]) -> None:
    call = decode_raw_request(bytes(body_len), "m", "", _model(TensorSpec("x", "FP32", dims),
                                                               batch=batch))
    (t,) = call.inputs
    assert (t.name, t.datatype, t.shape, len(t.raw_bytes())) == ("x", "FP32", shape, body_len)
    assert call.parameters == {"binary_data_output": True}  # every output answered in binary
    assert call.wire is not None and call.wire.header_length == 0


def test_a_bytes_input_of_one_element_gets_its_length_in_front() -> None:
    call = decode_raw_request(b"427", "m", "", _model(TensorSpec("s", "BYTES", (1,))))
    assert bytes(call.inputs[0].raw_bytes()) == b"\x03\x00\x00\x00427"
    assert call.inputs[0].shape == (1,)


def test_refusals_are_tritons_texts() -> None:
    two = _model(TensorSpec("a", "FP32", (4,)), TensorSpec("b", "FP32", (4,)))
    assert _refused(two, bytes(16)) == (
        "[request id: <id_unknown>] Raw request must only have 1 input (found 1) to be deduced "
        "but got 2 inputs in 'm' model configuration")
    assert _refused(_model(TensorSpec("x", "FP16", (-1, -1))), bytes(8)) == (
        "[request id: <id_unknown>] The shape of the raw input 'x' can not be deduced because "
        "there are more than one variable-sized dimension")
    assert _refused(_model(TensorSpec("s", "BYTES", (-1,))), b"abc") == (
        "[request id: <id_unknown>] For BYTE datatype raw input 's', the model must have input "
        "shape [1]")
    assert _refused(_model(TensorSpec("x", "FP32", (-1,))), bytes(10)) == (
        "[request id: <id_unknown>] input byte size mismatch for input 'raw_input' for model "
        "'m'. Expected 8, got 10")


@pytest.mark.parametrize("text,value", [("0", 0), ("abc", 0), ("", 0), (" 12", 12),
                                        ("12abc", 12), ("+3", 3)])
def test_header_length_is_read_as_atoi_reads_it(text: str, value: int) -> None:
    assert header_length_value(text, 100) == value
    assert is_raw(bytes(100), text) is (value == 0)


@pytest.mark.parametrize("text", ["-1", "101", "99999999999999999999"])
def test_a_header_length_outside_the_body_is_refused(text: str) -> None:
    with pytest.raises(ProxyError) as err:
        header_length_value(text, 100)
    assert err.value.message == f"inference header size should be in range (0, 100), got: {text}"
    assert not is_raw(bytes(100), None)
