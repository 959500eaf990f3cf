"""Model config rendering (``proxy.contract``): Triton's HTTP JSON form and its gRPC message."""

from __future__ import annotations

from tritonclient.grpc import model_config_pb2 as mc

from proxy.contract import ModelContract, TensorSpec, config_from_pb, config_to_json


def test_zero_values_and_int64_as_numbers_in_declaration_order() -> None:
    msg = mc.ModelConfig(name="m", max_batch_size=0)
    out = msg.output.add(name="probs", data_type=mc.TYPE_FP32, dims=[1000])
    out.reshape.shape.extend([1, 1000, 1, 1])
    msg.dynamic_batching.max_queue_delay_microseconds = 2**40
    doc = config_from_pb(msg.SerializeToString())
    assert doc["max_batch_size"] == 0
    assert doc["output"][0]["reshape"] == {"shape": [1, 1000, 1, 1]}
    assert doc["output"][0]["dims"] == [1000] and doc["output"][0]["label_filename"] == ""
    assert doc["dynamic_batching"]["max_queue_delay_microseconds"] == 2**40
    assert list(doc)[:6] == ["name", "platform", "backend", "runtime", "max_batch_size",
                             "input"]  # version_policy unset: a oneof message, left out
    assert "sequence_batching" not in doc and doc["input"] == [] and doc["parameters"] == {}


def test_json_and_message_forms_agree() -> None:
    msg = mc.ModelConfig(name="m", backend="python", max_batch_size=4)
    msg.input.add(name="x", data_type=mc.TYPE_STRING, dims=[-1], optional=True)
    msg.parameters["k"].string_value = "v"
    contract = ModelContract("m", ("1",), "python", (), (), 4, config=config_to_json(msg))
    assert mc.ModelConfig.FromString(contract.config_bytes()) == msg


def test_a_model_without_a_config_gets_tritons_form() -> None:
    contract = ModelContract(
        "clip", ("1",), "onnxruntime_onnx",
        (TensorSpec("pixels", "FP32", (-1, 3, 224, 224)), TensorSpec("ids", "INT64", (-1, 77))),
        (TensorSpec("text", "BYTES", (-1, 1)),), max_batch_size=8)
    doc = contract.config_json()
    assert doc["max_batch_size"] == 8 and doc["platform"] == "onnxruntime_onnx"
    assert [i["dims"] for i in doc["input"]] == [[3, 224, 224], [77]]
    assert doc["input"][0]["format"] == "FORMAT_NONE"
    assert doc["output"][0]["data_type"] == "TYPE_STRING"
    assert doc["version_policy"] == {"latest": {"num_versions": 1}}
    assert mc.ModelConfig.FromString(contract.config_bytes()).input[1].dims == [77]


def test_floats_as_tritons_printer_writes_them() -> None:
    msg = mc.ModelConfig(name="m")
    msg.sequence_batching.direct.minimum_slot_utilization = 0.1  # a 32-bit float field
    msg.sequence_batching.control_input.add(name="s").control.add(fp32_false_true=[0.0, 1.0])
    seq = config_to_json(msg)["sequence_batching"]
    assert seq["direct"]["minimum_slot_utilization"] == 0.1
    assert seq["control_input"][0]["control"][0]["fp32_false_true"] == [0, 1]
    assert type(seq["control_input"][0]["control"][0]["fp32_false_true"][0]) is int
