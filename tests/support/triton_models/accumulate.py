"""Python-backend ``sequence_accumulate`` (sequence batcher): a running sum per correlation id.

The sequence batcher gives every request three control tensors: ``START`` (1 on a sequence's
first request), ``END`` (1 on its last) and ``CORRID`` (the correlation id). ``OUTPUT`` is the
sum of ``INPUT`` over the sequence so far, so a request that reaches the model out of order
gives a wrong value, and one without START for an unknown id is an error naming the id.
"""

import numpy as np
import triton_python_backend_utils as pb_utils


def _scalar(request, name):
    return int(pb_utils.get_input_tensor_by_name(request, name).as_numpy().reshape(-1)[0])


class TritonPythonModel:
    def initialize(self, args):
        self.sums = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            value, start, end, corrid = (_scalar(request, n)
                                         for n in ("INPUT", "START", "END", "CORRID"))
            if start:
                self.sums[corrid] = 0
            elif corrid not in self.sums:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    f"sequence {corrid}: a request without START for a sequence that has none")))
                continue
            self.sums[corrid] += value
            total = self.sums[corrid]
            if end:
                del self.sums[corrid]
            out = pb_utils.Tensor("OUTPUT", np.array([[total]], dtype=np.int32))
            responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
        return responses
