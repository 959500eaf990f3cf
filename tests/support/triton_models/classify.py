"""Python-backend ``classify_fp32``: probs = x, emitted as [1, 10, 1, 1] (the config's reshape),
so clients see [10]; its labels file makes the classification extension answer
"score:index:label"."""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "x").as_numpy()
            probs = x.reshape(1, 10, 1, 1)
            responses.append(
                pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("probs", probs)])
            )
        return responses
