"""mmguard's benchmarks: a package, each bench run from the repository root as
``python -m bench.<name>`` (``python -m bench.proxy --help``); see bench/README.md.

Shared parts: :mod:`bench.common` (processes, the machine, CPU accounting from /proc, mmguard as
a child process, tables) and :mod:`bench.loadgen` (the load-generator process and its recorder).
Benches also import ``tests.support`` (Triton, vLLM, models, wire helpers), which is importable
because ``python -m`` puts the repository root on the path.
"""
