"""Worker scaling: mmguard's req/s and CPU per request with 1, 2, ... ``--workers``.

    python -m bench.workers [--workers-list 1,2] [--rounds 1] [--no-pin] [--out bench/out]

The package: :mod:`.plan` (the CPU-set plan and the efficiency arithmetic, pure), :mod:`.pod`
(mmguard with ``--workers N``, /proc walks), :mod:`.cells` (the load generators' cells),
:mod:`.run` (the cells in turn), :mod:`.report` (tables and files), ``__main__`` (the command
line).

The proxy must be the bottleneck, so the load generator, the backend and mmguard are pinned to
CPU sets apart (:func:`plan_cpus`; each is started from a thread whose affinity is that set, so
every process and thread it makes inherits it, and the set each really got is read back from
/proc and printed). mmguard's set is the same in every cell: between two cells only the
``--workers`` flag changes. What is measured per cell:

* FP32 [1,3,224,224] over gRPC and HTTP (KServe v2), routed by mmguard to (a) the in-process ONNX
  Runtime backend (the identity models ``bench.proxy.servers.write_ort_models`` writes; the
  inference runs inside mmguard's workers, so its CPU is in mmguard's figure) and (b) a real Triton
  (nvidia-pytriton) when one can start; plus the same load sent to Triton directly, once, as the
  ceiling the backend itself sets.
* req/s and latency from ``--loadgens`` load-generator processes; each keeps its share of
  ``--concurrency`` requests in flight over its share of ``--connections`` connections (gRPC: one
  channel each, with its own subchannel pool, so each is a TCP connection of its own; HTTP: one
  keep-alive session each). The kernel spreads connections over the workers' SO_REUSEPORT
  sockets by a hash, so how evenly the workers were loaded is reported too (busiest worker's
  CPU over the mean).
* CPU per request of the whole pod: the serve process and every process below it (supervisor +
  workers), found by parent pid in /proc at each sample, the supervisor's share apart.
* scaling efficiency = req/s at N / (N × req/s at 1 worker), and its bound on this machine:
  min(N, CPUs of mmguard's set) / N, with how much of its set the pod used (the bound holds
  only where one worker already filled it). ``--rounds`` walks the list in turn, medians shown.

The first answer on every connection of every cell is checked byte for byte (sent alone, before
the load starts). Results: a table on stdout, ``<out>/workers.json`` and ``<out>/workers.md``.
"""

DESCRIPTION = (__doc__ or "").split("\n\n")[0]
"""The first paragraph above: ``--help``'s description."""
