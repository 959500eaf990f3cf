"""Python-backend ``clip_demo``: runs the proxy's demo ONNX file with onnxruntime.

The file comes from the config parameter ``onnx_path``. ``similarity`` is [batch] in ONNX; the
config declares it ``dims: [1]`` with ``reshape: { shape: [] }`` so Triton exposes [batch, 1]
— see tests/support/triton.py for why.
"""

import json

import triton_python_backend_utils as pb_utils

OUTPUTS = ("image_embeds", "text_embeds", "similarity")


class TritonPythonModel:
    def initialize(self, args):
        import onnxruntime as ort

        config = json.loads(args["model_config"])
        path = config["parameters"]["onnx_path"]["string_value"]
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])

    def execute(self, requests):
        responses = []
        for request in requests:
            feeds = {
                name: pb_utils.get_input_tensor_by_name(request, name).as_numpy()
                for name in ("pixel_values", "input_ids")
            }
            results = self.session.run(list(OUTPUTS), feeds)
            tensors = [
                pb_utils.Tensor(name, value) for name, value in zip(OUTPUTS, results, strict=True)
            ]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses
