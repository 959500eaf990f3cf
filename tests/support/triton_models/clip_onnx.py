"""Python-backend ``clip_demo``: runs the proxy's demo ONNX file with onnxruntime.

The file comes from the config parameter ``onnx_path``. Slowed on cue: while the file named by
the parameter ``cue_file`` exists (JSON), each request first sleeps ``delay_ms`` and its
``similarity`` is multiplied by ``similarity_scale``, or replaced by ``similarity`` when the cue
names one (a degraded replica, for routing tests); ``embed_noise`` adds Gaussian noise of that σ
to ``image_embeds`` (a perturbed canary, for shadowing tests), drawn from ``seed`` (0), or
afresh for every request when ``seed`` is null (a non-deterministic model). ``slowdown`` (e.g.
1.3) makes each request take that many times its own work (the delay and the ONNX run; both
slept at once after the run): a model slower in itself by a ratio, whatever the machine's load
makes that work cost.
``similarity`` is [batch] in ONNX; the config declares it ``dims: [1]`` with
``reshape: { shape: [] }`` so Triton exposes [batch, 1] — see tests/support/triton.py for why.
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
        path = config["parameters"]["onnx_path"]["string_value"]
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        self.cue_file = config["parameters"].get("cue_file", {}).get("string_value", "")

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
            delay_s, slowdown = float(cue.get("delay_ms", 0)) / 1000, float(cue.get("slowdown", 1))
            if slowdown <= 1:
                time.sleep(delay_s)
            started = time.perf_counter()
            feeds = {
                name: pb_utils.get_input_tensor_by_name(request, name).as_numpy()
                for name in ("pixel_values", "input_ids")
            }
            results = self.session.run(list(OUTPUTS), feeds)
            results[2] = results[2] * float(cue.get("similarity_scale", 1.0))
            if "similarity" in cue:  # a replica whose answers went bad: one fixed value
                results[2] = results[2] * 0 + float(cue["similarity"])
            if cue.get("embed_noise"):  # a variant whose embeddings drift (canary tests)
                seed = cue.get("seed", 0)  # null: a fresh draw each time (non-deterministic)
                rng = np.random.default_rng(None if seed is None else int(seed))
                results[0] = (results[0] + rng.normal(0, float(cue["embed_noise"]),
                                                      results[0].shape)).astype(np.float32)
            if slowdown > 1:  # one sleep, as the unslowed model has: the same oversleep
                time.sleep(slowdown * delay_s + (slowdown - 1) * (time.perf_counter() - started))
            tensors = [
                pb_utils.Tensor(name, value) for name, value in zip(OUTPUTS, results, strict=True)
            ]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses
