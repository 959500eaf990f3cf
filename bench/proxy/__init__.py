"""mmguard vs nginx vs direct: throughput and latency over KServe v2 gRPC and HTTP, in one run.

    python -m bench.proxy [--duration 5] [--warmup 1] [--out bench/out]

What runs (all on 127.0.0.1, every server its own process):

* a real Triton (``tests/support/triton.py``: the nvidia-pytriton binary, Python-backend models
  ``pixel_identity`` FP32 [1,3,224,224] identity and ``small_fp32`` FP32 [1,16] y = 2x);
* mmguard (``python -m proxy.cli serve``) routing ``pixel_identity``/``small_fp32`` to a
  ``triton_grpc`` backend, ``pixel_identity_h``/``small_fp32_h`` (``backend_model``) to a
  ``triton_http`` backend and ``identity_pixel``/``identity_small`` (FP32 identity ONNX models,
  [-1,3,224,224] and [-1,16]) to an in-process ``onnxruntime`` backend;
* nginx (``grpc_pass`` on an h2c listener, ``proxy_pass`` with a keep-alive upstream) in front of
  the same Triton, from ``bench/nginx.conf.template``;
* one load-generator process (spawned, so its event loop shares nothing with the servers):
  gRPC = ``grpc.aio`` raw unary calls with pre-serialized ``ModelInferRequest`` bytes, HTTP =
  ``aiohttp`` with a pre-built binary body (``Inference-Header-Content-Length``). It keeps
  ``concurrency`` requests in flight on one connection/channel (HTTP: a pool of up to
  ``concurrency`` keep-alive connections). The first answer of every cell is checked byte for
  byte against the expected output before the cell is measured.

For the ONNX Runtime rows there is no out-of-process equivalent, so "direct" is the same model
run in the load-generator process: a plain ``session.run`` loop at concurrency 1, and at higher
concurrency ``concurrency`` callers sharing a pool of ``--ort-threads`` threads (what mmguard's
backend does), so that queueing is the same on both sides.

Besides req/s and latency, every cell records the CPU time each process spent during the
measured window (from /proc), as ms of CPU per request: on a small machine the servers and the
load generator compete for the same cores, and CPU per request says who is paying.

The full chain's price (``bench/chain_study.py``): ``--chains`` (default ``default,full,
full_shadow10``) or ``--chain-study`` (one filter added at a time) measures mmguard's CPU per
request with each chain on the 600 KB case over gRPC and HTTP, served by one more mmguard
process; ``--chain-only`` skips the matrix above.

Results: a table on stdout, ``<out>/results.json`` and ``<out>/results.md``. Every process is
stopped on exit, Ctrl-C and SIGTERM included (children also get SIGTERM if this script is
SIGKILLed: ``PR_SET_PDEATHSIG``).

The package: :mod:`.cases` (the tensors and routes measured), :mod:`.cells` (what the
load-generator process runs per cell), :mod:`.servers` (Triton, mmguard, nginx, the
pass-through floor), :mod:`.run` (the matrix), :mod:`.report` (tables, ratios, files) and
``__main__`` (the command line).
"""

DESCRIPTION = (__doc__ or "").split("\n\n")[0]
"""The first paragraph above: ``--help``'s description."""
