"""Python-backend ``fail_fp32``: every request gets an error response (TritonError, INTERNAL)."""

import triton_python_backend_utils as pb_utils

MESSAGE = "deliberate failure from fail_fp32"


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse(error=pb_utils.TritonError(MESSAGE)) for _ in requests]
