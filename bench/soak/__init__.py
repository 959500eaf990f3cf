"""Soak: sustained mixed load on one mmguard process for a given time; RSS must stay flat.

    python -m bench.soak --minutes 60
    python -m bench.soak --minutes 10 --vllm http://127.0.0.1:8000   # + OpenAI streaming chat

mmguard runs as its own process (``python -m proxy.cli serve``, bench/common.py) on in-process
ONNX Runtime with ``clip_demo`` and the ``identity_<dtype>`` models of the tests. This script
keeps ``--concurrency`` requests in flight per kind, all valid and checked:

* ``grpc``: ModelInfer, raw ``grpc.aio`` unary, FP32 [4096] to identity_fp32 (output == input);
* ``grpc_stream``: ModelStreamInfer, each worker a bidirectional stream of 50 requests, then a
  new stream. ONNX Runtime has no decoupled model, so every request has exactly one response;
* ``http_json``: v2 JSON, INT64 [64] to identity_int64 (output == input);
* ``http_binary``: v2 binary extension, clip_demo (pixel_values [1,3,224,224] + input_ids
  [1,77]), 3 outputs, similarity within [-1, 1];
* ``bad``: invalid requests, HTTP and gRPC (shape/size mismatch, unknown model, malformed
  JSON), whose expected 4xx / gRPC code counts as success (leaks often live in error paths);
* ``openai_stream`` with ``--vllm URL``: streaming chat completions through a ``vllm`` backend.

Every ``--interval`` seconds: one line with requests/s and p50/p99 ms per kind, errors by kind
and code, and mmguard's RSS (/proc/<pid>/status VmRSS) and open file descriptors. At the end: a
summary with RSS first/last/max and its slope in MiB per hour (least squares over the samples
after ``--warmup``), and exit code 1 when the slope exceeds ``--max-rss-slope-mib-per-h`` or any
request failed unexpectedly. Samples go to ``<out>/soak.json``.

The package: :mod:`.load` (what each kind sends and how its answer is checked) and
``__main__`` (the sampler, the summary, the command line).
"""

DESCRIPTION = (__doc__ or "").split("\n\n")[0]
"""The first paragraph above: ``--help``'s description."""
