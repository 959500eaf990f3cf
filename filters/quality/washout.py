"""A bright tone curve that washed the picture out (``washout``): a scene signal of its own
module (scenes.py is full), registered with the others in ``scenes.SCENE_SIGNALS`` and measured
only when a rule names it (``scenes.OPTIONAL_SIGNALS``: no default rule holds on every kind of
clean input). What it catches and confuses on real photographs: docs/quality.md, Round 8.

Rules that MUST hold: the score is finite and in [0, 1]; on the evaluation set, no photograph
under the curve value^0.5 scores above its clean source (tests/unit/test_quality_tone_bright.py).
"""

from __future__ import annotations

import math

import numpy as np

from filters.quality.measure import F32, NEAR_WHITE, Signal
from filters.quality.measure import ramp as _ramp

WASHOUT_BAD, WASHOUT_GOOD = 0.80, 0.40  # key of the pixels below white; see washout()
_KEY_DELTA = np.float32(0.01)  # as tone's key: log(0.01 + L)
_DARKS = np.float32(0.68)  # luminance: a dark tone, for washout, is any pixel under this
_DARKS_SHARE = 0.01  # washout reads only a picture with at least this share of dark tones


def washout(plane: F32) -> Signal:
    """A bright tone curve (value^γ, γ < 1: a "lift shadows" or "brighten" slider) that washed
    the picture out, told from a high-key scene by the shape of its histogram.

    The key (as in ``tone``) of the pixels below white (0.9): a curve lifts every mid-tone and
    shadow, so a photograph's 0.2-0.5 rises to 0.5-0.7 at γ 0.5, while the white the curve
    cannot lift further is left out. A white product shot keeps its subject's own key (the
    backdrop is white, so not counted); a snow field has no dark tones at all, and is not
    read: the key counts only where at least 1 % of the picture lies under 0.68 (the darkest
    tones of every photograph of the evaluation set stay under it at γ 0.5, of 91 % at γ 0.33;
    a snow field starts at 0.72).
    0.80 scores 0, 0.40 scores 1 (0.5 at 0.60, above every clean photograph of the evaluation
    set and all but one random crop: docs/quality.md, Round 8). Read on a grid of every 4th
    row and column (a 16th of the pixels: the log is the cost).

    No default rule (opt-in): a bright-field stained slide, a light page and a light UI read
    washed out. Known confusions: a strong haze or mist (a veil lifts the darks as a curve
    does) and, likely, a phone's HDR rendering read washed out; a backlit photo does not; a
    photograph with much pure black (0^γ = 0) is missed; a snow scene with a dark object in it
    is read as any picture is."""
    sub = plane[::4, ::4]
    below = sub[sub < NEAR_WHITE]  # a copy: its log is taken in place
    if below.size == 0:
        return Signal(1.0, 1.0, "key below white (nothing below white)")
    darks = np.count_nonzero(below < _DARKS)
    below += _KEY_DELTA
    np.log(below, out=below)
    key = math.exp(float(below.sum(dtype=np.float64)) / below.size)
    if darks < _DARKS_SHARE * sub.size:
        return Signal(1.0, key, "key below white (no dark tones: a high-key scene, not read)")
    return Signal(_ramp(key, WASHOUT_BAD, WASHOUT_GOOD), key, "key below white (log-average "
                  "luminance of the pixels under 0.9)")
