"""Python-backend ``decoupled_counter`` (decoupled): ``count`` responses 0..count-1, 10 ms apart.

After the last value (or at once for count == 0) it sends an empty response flagged
TRITONSERVER_RESPONSE_COMPLETE_FINAL. A negative count gets one error response (also FINAL).
If the request is cancelled mid-stream, it stops sending values and sends only the FINAL flag.
"""

import time

import numpy as np
import triton_python_backend_utils as pb_utils

INTERVAL_S = 0.010


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            count = int(
                pb_utils.get_input_tensor_by_name(request, "count").as_numpy().reshape(-1)[0]
            )
            if count < 0:
                sender.send(
                    pb_utils.InferenceResponse(
                        error=pb_utils.TritonError(f"count must be >= 0, got {count}")
                    ),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )
                continue
            for i in range(count):
                if i:
                    time.sleep(INTERVAL_S)
                if sender.is_cancelled():
                    print(f"decoupled_counter: cancelled after {i} responses", flush=True)
                    break
                value = pb_utils.Tensor("value", np.array([i], dtype=np.int32))
                sender.send(pb_utils.InferenceResponse(output_tensors=[value]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        # decoupled: execute returns None; every response went through the sender
