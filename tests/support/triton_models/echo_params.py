"""Python-backend ``echo_params``: OUTPUT0 = INPUT0, PARAMS = [the request's parameters as JSON
text], so a test sees exactly which parameters reached the model."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            params = np.array([request.parameters().encode()], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUTPUT0", x), pb_utils.Tensor("PARAMS", params)]))
        return responses
