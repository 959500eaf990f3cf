"""Whether the quality signals run their fused C passes (``_kernels.c``) or their numpy code.

The C module is built at install where a C compiler is found (setup.py marks it optional); the
numpy code is the reference, gives the same values but for the last bits of a sum, and runs
where the module is missing or ``MMGUARD_QUALITY_KERNELS=0`` is set. Read ``kernels`` at call
time (``native.kernels``), never import the name: the tests switch it off to compare.
"""

from __future__ import annotations

import os
from types import ModuleType

kernels: ModuleType | None
try:
    from filters.quality import _kernels as kernels
except ImportError:  # not built: no compiler at install, or a source checkout never installed
    kernels = None
if os.environ.get("MMGUARD_QUALITY_KERNELS", "1") == "0":
    kernels = None

