"""Python-backend ``clip_fragile``: the demo ONNX model, made fragile to input noise.

A canary variant for robustness tests: on clean (smooth) images it answers exactly what
``clip_demo`` answers, so it agrees with production on every clean copy; once the image is
rough — the mean absolute difference between horizontally neighbouring pixels above the
``roughness`` parameter (0.03), as Gaussian or sign noise makes it — its image embeddings flip
sign (and the similarity with them): a model whose answers break under small noise. Patch
masking or occlusion of a smooth image adds only a few edges and leaves it as it was.
While the file named by the parameter ``cue_file`` exists (JSON), each request first sleeps
``delay_ms``: a model of realistic latency, for the verdict's latency tests; with
``"fragile": false`` it skips the roughness check too, doing exactly ``clip_demo``'s work (a
production twin whose time the canary's can be compared with).
"""

import json
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils

OUTPUTS = ("image_embeds", "text_embeds", "similarity")


class TritonPythonModel:
    def initialize(self, args):
        import onnxruntime as ort

        config = json.loads(args["model_config"])
        params = config["parameters"]
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(params["onnx_path"]["string_value"], options,
                                            providers=["CPUExecutionProvider"])
        self.roughness = float(params.get("roughness", {}).get("string_value", "0.03"))
        self.cue_file = params.get("cue_file", {}).get("string_value", "")

    def _cue(self):
        if self.cue_file and os.path.exists(self.cue_file):
            try:
                with open(self.cue_file) as f:
                    return json.load(f)
            except (OSError, ValueError):
                pass
        return {}

    def execute(self, requests):
        responses = []
        for request in requests:
            cue = self._cue()
            time.sleep(float(cue.get("delay_ms", 0)) / 1000)
            feeds = {
                name: pb_utils.get_input_tensor_by_name(request, name).as_numpy()
                for name in ("pixel_values", "input_ids")
            }
            results = self.session.run(list(OUTPUTS), feeds)
            if not cue.get("fragile", True):
                responses.append(pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor(name, value) for name, value in zip(OUTPUTS, results,
                                                                         strict=True)]))
                continue
            pixels = feeds["pixel_values"].astype(np.float64)
            rough = np.abs(np.diff(pixels, axis=-1)).mean(axis=(1, 2, 3))  # per batch item
            flip = np.where(rough > self.roughness, -1.0, 1.0).astype(np.float32)
            results[0] = results[0] * flip[:, None]
            results[2] = results[2] * flip
            tensors = [
                pb_utils.Tensor(name, value) for name, value in zip(OUTPUTS, results, strict=True)
            ]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses
