"""What every quality signal returns: a ``Signal`` (a score in [0, 1] and the raw value behind
it), and the ramp that maps a value to a score. Its own module so the first-round signals
(``signals``) and the edge scenes' (``scenes``) share it without importing each other both ways.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

F32 = NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class Signal:
    score: float  # in [0, 1]; 1 = nothing wrong
    value: float  # the raw measurement the score was mapped from
    what: str  # how to read the value in a message, e.g. "NaN/Inf values"


def ramp(x: float, bad: float, good: float) -> float:
    """0 at ``bad``, 1 at ``good``, linear between (either direction), clipped."""
    t = (x - bad) / (good - bad)
    return 0.0 if t <= 0.0 else 1.0 if t >= 1.0 else float(t)
