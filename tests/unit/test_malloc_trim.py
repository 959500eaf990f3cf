"""proxy/wire/image_decode.py sets glibc's mmap threshold (decoded images go back to the system);
the trim threshold it fixes as a side effect is set too, so a request-sized buffer freed at the
top of the heap is reused, not given back and faulted in again page by page."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import resource, numpy as np
import proxy.wire.image_decode  # the process-wide malloc settings
src = np.ones(150528, np.float32)  # a 600 KB FP32 [1,3,224,224] tensor
for _ in range(20):
    np.asarray(src, dtype=np.float64).mean()  # a 1.2 MB temporary, freed at once
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(200):
    np.asarray(src, dtype=np.float64).mean()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 200)
"""


def test_a_freed_request_sized_buffer_is_reused_without_page_faults() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         timeout=60, check=True, cwd=ROOT, env=env)
    faults = float(out.stdout.strip())
    # trimmed at 128 KiB, each copy faulted its ~290 pages in again; reused, none
    assert faults < 10, f"{faults} minor page faults per 1.2 MB temporary"
