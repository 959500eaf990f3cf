"""Python-backend identity: OUTPUT = INPUT, byte for byte, for any datatype.

Input and output names come from the model config (first input -> first output), so one file
serves identity_fp32/fp16/bf16/int64/bool/bytes and pixel_identity. BF16 has no numpy dtype,
so it is passed through DLPack; every other type goes through ``as_numpy``.
"""

import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.input_name = config["input"][0]["name"]
        self.output_name = config["output"][0]["name"]
        self.via_dlpack = config["input"][0]["data_type"] == "TYPE_BF16"

    def execute(self, requests):
        responses = []
        for request in requests:
            tensor = pb_utils.get_input_tensor_by_name(request, self.input_name)
            if self.via_dlpack:
                out = pb_utils.Tensor.from_dlpack(self.output_name, tensor.to_dlpack())
            else:
                out = pb_utils.Tensor(self.output_name, tensor.as_numpy())
            responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
        return responses
