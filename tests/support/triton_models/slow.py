"""Python-backend ``slow_fp32``: y = x after sleeping ``delay_ms`` milliseconds.

``delay_ms`` is an optional INT32 input (first element used; absent -> no sleep). The sleep is
cut into 5 ms slices; if Triton marks the request cancelled (client deadline passed, stream
closed) the model stops, answers CANCELLED and prints ``slow_fp32: cancelled after N ms`` to the
server log so tests can prove the cancellation reached the backend.
"""

import time

import triton_python_backend_utils as pb_utils

_SLICE_S = 0.005


def _cancelled_error(elapsed_ms):
    code = getattr(pb_utils.TritonError, "CANCELLED", None)
    message = f"slow_fp32: cancelled after {elapsed_ms} ms"
    if code is None:
        return pb_utils.TritonError(message)
    return pb_utils.TritonError(message, code)


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "x").as_numpy()
            delay = pb_utils.get_input_tensor_by_name(request, "delay_ms")
            delay_s = float(delay.as_numpy().reshape(-1)[0]) / 1000.0 if delay is not None else 0.0
            start = time.monotonic()
            cancelled = False
            while True:
                left = delay_s - (time.monotonic() - start)
                if left <= 0:
                    break
                if request.is_cancelled():
                    cancelled = True
                    break
                time.sleep(min(_SLICE_S, left))
            if cancelled:
                elapsed_ms = int((time.monotonic() - start) * 1000)
                print(f"slow_fp32: cancelled after {elapsed_ms} ms", flush=True)
                responses.append(pb_utils.InferenceResponse(error=_cancelled_error(elapsed_ms)))
            else:
                responses.append(
                    pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("y", x)])
                )
        return responses
