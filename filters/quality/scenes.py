"""Image signals for the real edge scenes: a phone photo of a screen, a ghosted frame, a tone
curve that sank the picture or blew it out; and whether a bright picture is drawn (a
screenshot, clip art) rather than an over-exposed photograph (``graphic``, for exposure).

Guards against the inputs users really send and the first round's signals could not see: a
screen photographed at an angle (the seeds' "screenshot distortion": AUC 0.50 before), a faint
shifted copy of the frame (the seeds' "OCR residue", a previous video frame: AUC 0.50), a
gamma 2.2-3 curve (AUC 0.51-0.63 on the exposure signal) and an over-exposure by 1.5-2×. Each is
a ``Signal`` of the luminance plane at ~224 px (``luma.luminance``): score in [0, 1], 1 =
nothing wrong; what each catches and confuses on real photographs is in docs/quality.md. The
ghosted frame's signal is read from the cepstrum in its own module (``echo``), and moiré from
the spectrum in its own (``moire``), both imported here so every scene signal is found in one
place.

Rules that MUST hold: scores are finite and in [0, 1]; a degraded copy never scores above its
clean source on the signal that measures that degradation, on the evaluation set (one stated
exception: an image whose own repetition reads as a faint ghost that a shifted copy blurs,
brick and one rocket crop).
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import NDArray

from filters.quality import native
from filters.quality.echo import ghosting as ghosting  # its code: echo.py
from filters.quality.measure import BLOWN as _BLOWN
from filters.quality.measure import F32, Levels, Signal, levels, tile_sums
from filters.quality.measure import ramp as _ramp
from filters.quality.moire import moire as moire  # its code: moire.py

SCENE_SIGNALS = ("perspective", "tone", "shake", "ghosting", "moire", "washout")
# Measured only when a rule names it: ghosting and moire for their cost; washout because no
# default rule holds on every kind of clean input (a stained slide reads washed out); its code
# is filters/quality/washout.py; residue (filters/quality/residue.py, a request's images
# compared with each other) because two frames of one scene that changed can read as a copy.
OPTIONAL_SIGNALS = frozenset({"ghosting", "moire", "washout", "residue"})
_EDGE_TOL = 0.03  # luminance: a margin pixel is within this of the border's own colour
_EDGE_FLAT = 0.015  # luminance: half the border's IQR, at most, for a flat surround
_SURROUND_DARKER = 0.05  # the surround is darker than the picture's median by at least this
_EDGE_INLIER = 1.5  # px: a point of a straight edge is within this of its line
_OBLIQUE = 0.01  # px per px: an edge leaning more than this is not the frame's own
KEY_DARK, KEY_LIT = 0.08, 0.18  # log-average luminance; see tone()
CLIPPED_BAD, CLIPPED_GOOD = 0.45, 0.2  # share clipped white reached by a gradient; tone()
_KEY_DELTA = np.float32(0.01)
_BLACK = np.float32(0.02)  # at or below: crushed black, as flat in a photo as in a drawing
_FLAT_STEP = np.float32(0.5 / 255)  # luminance: neighbours closer than this are one flat colour
FLAT_PHOTO, FLAT_GRAPHIC = 0.16, 0.19  # share of flat-colour pixels; see graphic()
RAMPED_GRAPHIC, RAMPED_PHOTO = 0.2, 0.35  # near-white over blown-white share; see graphic()


def graphic(plane: F32, ramped: float) -> float:
    """How much a bright picture looks drawn rather than photographed, in [0, 1]: the share of
    its pixels (neither blown white nor black) that equal both their left and upper neighbours
    (flat colour: a UI's bars and buttons, clip art's fills; 0.16 reads 0, 0.19 reads 1), and
    how little of its white is reached through a gradient (``ramped``: pixels at 0.9 up to
    blown white over the blown ones; a gain clips a smooth ramp of tones into white, a drawing
    jumps to it: 0.35 reads 0, 0.2 reads 1); the lower of the two.

    On the evaluation set: light-mode screenshots read flat 0.24-0.32 and ramped 0.06-0.08,
    illustrations 0.19-0.24 and 0.04-0.22. The over-exposed photographs nearest to a drawing:
    brick at 2× (flat 0.13-0.155: it stays a photograph) and the rocket's crops (flat up to
    0.22, ramped 0.27 or more; none of them was flagged before either). Sensor noise and
    texture make a photograph's neighbours differ: the median clean photograph reads 0.02."""
    if min(plane.shape) < 2:
        return 0.0
    inner = plane[1:, 1:]
    same = np.abs(inner - plane[:-1, 1:]) < _FLAT_STEP
    same &= np.abs(inner - plane[1:, :-1]) < _FLAT_STEP
    same &= inner < _BLOWN
    same &= inner > _BLACK
    coloured = np.count_nonzero(inner < _BLOWN)
    share = np.count_nonzero(same) / max(coloured, 1)
    return min(_ramp(share, FLAT_PHOTO, FLAT_GRAPHIC), _ramp(ramped, RAMPED_PHOTO, RAMPED_GRAPHIC))


def _straight_edge(depth: NDArray[np.intp], inward: int) -> tuple[bool, float]:
    """Whether the flat margin of one side ends on a straight line: (straight, slope).

    ``depth`` is, per row of the side, how far in the first pixel unlike the border is. Rows
    with nothing but margin (past the edge's end) are left out; the line is the median of
    slopes over half the side (Theil-Sen-like, robust to the corners where another edge takes
    over), and it is straight when 35 % of the side lies within 1.5 px of it."""
    n = depth.size
    lo, hi = n // 10, n - n // 10
    t = np.arange(lo, hi)
    y = depth[lo:hi].astype(np.float32)
    keep = y < 0.6 * inward
    if keep.mean() < 0.4:
        return False, 0.0
    t, y = t[keep], y[keep]
    half = t.size // 2
    slope = float(np.median((y[half:2 * half] - y[:half]) / (t[half:2 * half] - t[:half])))
    offset = float(np.median(y - slope * t))
    inliers = np.abs(y - slope * t - offset) <= _EDGE_INLIER
    straight = inliers.sum() >= 0.35 * n and float(y[inliers].mean()) >= 1.5
    return straight, slope


def perspective(plane: F32) -> Signal:
    """A screen (or a page) photographed at an angle: the picture is a quadrilateral inside a
    flat surround (the bezel, the desk), whose sides are straight lines that lean.

    Per side of the frame whose border is a flat surround (half its IQR ≤ 0.015) darker
    than the picture (a lit screen is brighter than its bezel and the room): the depth of the
    flat margin (pixels within 0.03 of the border's median, or 3 × its spread) in every
    row, and whether that depth follows a straight line (``_straight_edge``). With two or
    more straight margin edges, the value is the number that lean (slope ≥ 0.01): 0 scores 1
    (a letterboxed frame, a screen shot straight on), 2 or more score 0. A photograph has no
    flat margin on two sides ending on straight lines, so it reads 0.

    Known confusions: a screen that fills the frame (no surround) or moiré alone is not seen;
    a bezel with reflections or strong noise breaks the flat margin, a surround brighter than
    the screen (a dark-mode screen on a white desk) is not looked at; a photo of a framed
    picture or a document on a desk, taken at an angle, reads as a screen photo (it is the same
    geometry); a picture rotated by the client with a fill colour reads as one."""
    if min(plane.shape) < 32:
        return Signal(1.0, 0.0, "leaning straight margin edges (image too small)")
    straight = leaning = 0
    h, w = plane.shape
    # Each border's median and half its interquartile range (about its median deviation),
    # two partitions for the four: this runs on every image, and most have no flat border.
    sides = []
    views = (plane, plane[:, ::-1], plane.T, plane.T[:, ::-1])  # left, right, top, bottom
    kernels = native.kernels
    if kernels is not None:  # the same order statistics, selected in C from the four sides
        stats = kernels.borders(np.ascontiguousarray(plane, np.float32), h, w)
        for k, view in enumerate(views):
            if stats[2 * k + 1] <= _EDGE_FLAT:
                sides.append((view, stats[2 * k], stats[2 * k + 1]))
    else:
        for borders, pair in ((plane[:, [0, -1]].T, views[:2]), (plane[[0, -1]], views[2:])):
            n = borders.shape[1]
            q = np.partition(borders, (n // 4, n // 2, 3 * n // 4), axis=1)
            for view, ref, spread in zip(pair, q[:, n // 2].tolist(),
                                         ((q[:, 3 * n // 4] - q[:, n // 4]) * 0.5).tolist(),
                                         strict=True):
                if spread <= _EDGE_FLAT:  # a flat surround on this side
                    sides.append((view, ref, spread))
    if len(sides) < 2:
        return Signal(1.0, 0.0, "leaning straight margin edges (no flat surround)")
    inside = float(np.median(plane[h // 4:h - h // 4:4, w // 4:w - w // 4:4]))  # the centre
    for side, ref, spread in sides:
        if ref > inside - _SURROUND_DARKER:
            continue  # not darker than the picture (a lit screen is brighter than its bezel)
        tol = max(_EDGE_TOL, 3.0 * spread)
        reach = int(0.6 * side.shape[1]) + 1  # a margin deeper than 60 % is not a margin
        unlike = np.abs(side[:, :reach] - ref) > tol
        depth = np.where(unlike.any(axis=1), unlike.argmax(axis=1), side.shape[1])
        ok, slope = _straight_edge(depth, side.shape[1])
        straight += ok
        leaning += ok and abs(slope) >= _OBLIQUE
    value = float(leaning) if straight >= 2 else 0.0
    return Signal(_ramp(value, 2.0, 0.0), value,
                  f"leaning straight margin edges ({straight} straight of 4 sides)")


def tone(plane: F32, lv: Levels | None = None) -> Signal:
    """A tone curve that sank or blew the picture, from the histogram's shape.

    Dark: the log-average luminance (the "key" of Reinhard's tone mapping,
    exp(mean(log(0.01 + L)))). A curve value^γ multiplies its logarithm by about γ, so gamma 3
    sinks a photograph's key from 0.2-0.5 to under 0.1, while the exposure signal forgives it
    because the highlights stay bright. 0.08 scores 0, 0.18 scores 1 (0.5 at 0.13: the 1st
    percentile of clean photographs and random crops, the operating point in docs/quality.md).
    Bright: the share of white clipped (≥ 0.98) reached through a gradient (in proportion to
    the pixels just below it, 0.9-0.98, over the clipped ones: a gain clips a smooth ramp of
    tones, while paper and flat-colour graphics jump straight to white), and, as in
    ``exposure``, only where the picture has mid-tones or lacks ink (a page is white plus
    ink). 45 % scores 0, 20 % 1.
    The lower of the two is the score.

    Known confusions: a night scene, a dark stage or a dark-mode screenshot that fills the
    frame with black reads dark (the exposure signal forgives highlights; this one does not);
    a high-key scene (snow, a white product shot, a bright sky filling most of the frame) is
    bright by the same measure as an over-exposed photo, which is why the bright half's
    operating point catches few over-exposures (docs/quality.md)."""
    if plane.size == 0:
        return Signal(0.0, 0.0, "log-average luminance (empty image)")
    flat = plane.reshape(-1)
    # the key of a quarter orders images the same way, 4x cheaper (log)
    count = (flat.size + 3) // 4
    kernels = native.kernels
    if kernels is not None:  # logarithms of products: the same sum to a double's precision
        total = kernels.log_sum(np.ascontiguousarray(flat, np.float32), flat.size, 4,
                                _KEY_DELTA)
    else:
        total = float(np.log(flat[::4] + _KEY_DELTA).sum(dtype=np.float64))
    key = math.exp(total / count)
    lv = lv or levels(plane)
    clipped, ink, mid = lv.clipped, lv.ink, lv.mid
    near = lv.near_white - clipped
    # A page or a UI is white plus ink, with few mid-tones: its white is paper, not clipping.
    page = max(_ramp(mid, 0.15, 0.35), _ramp(ink, 0.03, 0.005))
    blown = clipped * _ramp(near / clipped if clipped else 0.0, 0.03, 0.25) * page
    dark = _ramp(key, KEY_DARK, KEY_LIT)
    bright = _ramp(blown, CLIPPED_BAD, CLIPPED_GOOD)
    if dark <= bright:
        return Signal(dark, key, "log-average luminance (key)")
    return Signal(bright, blown, f"share of white clipped from a gradient ({clipped:.0%} at "
                  f"white, {near:.0%} just below)")


SHAKE_BAD, SHAKE_GOOD = 0.3, 0.7  # noise-free edge ratio of the edge tiles; see shake()
_SHAKE_TILES = 4  # per side
_SHAKE_EDGE = 9.0  # a tile holds edges when its first-difference energy is 9× the noise's
_SHAKE_RANK = 3  # the third-sharpest edge tile
_SHAKE_DIRECTIONS = ((0, 1), (1, 0), (1, 1), (1, -1))  # the axes and the diagonals
_SHAKE_FLOORS = np.array((1e-12, 0.0), np.float32).reshape(2, 1, 1, 1)  # first, second energy


def shake(plane: F32, sigma: float) -> Signal:
    """Camera shake and blur under sensor noise, the case ``sharpness`` reads as sharp: a real
    shaken photograph (scikit-image's clock) keeps its sensor noise and 8-bit steps unblurred,
    as they are added after the optics, and that noise, sharp in every direction, fills the
    second differences ``sharpness`` counts (the clock read ratio 1.33-2.19: sharp).

    Per tile of a 4 × 4 grid and per direction (the two axes and the two diagonals: a shake
    smears one of them most): the energy of the second difference over that of the first,
    each less the share white noise of σ ``sigma`` (the ``noise`` signal's estimate) puts
    there (6σ² and 2σ²): what is left is the edges' own. A tile counts when its first
    difference carries at least 9× the noise's energy in some direction (edges, not a bare
    wall); its ratio is its lowest direction's. The value is the third-sharpest counted tile (a
    sharp subject on a soft background stays sharp; one or two tiles where a shake runs along
    the edges do not decide). No counted tile: 1 (nothing to judge; ``constant`` and
    ``sharpness`` speak for a flat picture). 0.3 scores 0, 0.7 scores 1 (0.5 at 0.5: the
    lowest clean photograph or random crop reads 0.67, a crop of the flower; the clock's five
    views 0.04-0.44; at 0.55 the up-sampled checkerboard, 0.52, would be flagged).
    Differences are taken at every other pixel of every other row (~730 per tile).

    Known confusions: defocus and up-sampling lower it as they lower ``sharpness`` (it is
    the same ratio, cleaned of noise); noise that is not white (a picture up-scaled after the
    noise, JPEG at a low quality) is under-subtracted and reads sharper than it is; a picture
    soft by nature (microscopy, smooth gradients) reads shaken; under heavy noise only a few
    tiles keep 9× the noise's edge energy and the one read can be soft (1-2 of 99 photographs
    with noise σ 0.02-0.06 read shaken); a blur strong enough that no tile keeps 9× the
    noise's edge energy reads 1 (the other signals see it)."""
    t = _SHAKE_TILES
    h, w = plane.shape
    if min(h, w) < 8 * t:
        return Signal(1.0, 2.0, "noise-free edge ratio (image too small)")
    th, tw = (h - 2) // (2 * t), (w - 2) // (2 * t)
    kernels = native.kernels
    if kernels is not None:  # the same sums and choice in C: one pass, no lattice copies
        sums = np.empty((2, len(_SHAKE_DIRECTIONS), t, t), np.float32)
        kernels.shake(np.ascontiguousarray(plane, np.float32), h, w, t, sums)
        return _shake_signal(*kernels.shake_pick(sums, t, th * tw, sigma, _SHAKE_RANK,
                                                 _SHAKE_EDGE))
    return _shake_signal(*_shake_pick(_shake_sums(plane, th, tw, t), th * tw, sigma))


def _shake_pick(sums: F32, area: int, sigma: float) -> tuple[float, int]:
    """shake's value and its count of edge tiles from the tile sums (2, 4, t, t), by numpy."""
    energy = sums / np.float32(area)
    noise2 = np.float32(sigma) ** 2
    edges = (energy[0] > 2 * noise2 * _SHAKE_EDGE + 1e-9).any(axis=0)
    energy -= np.array((2 * noise2, 6 * noise2), np.float32).reshape(2, 1, 1, 1)  # noise's share
    np.maximum(energy, _SHAKE_FLOORS, out=energy)
    ratio = (energy[1] / energy[0]).min(axis=0)
    counted = np.sort(ratio[edges])
    if counted.size == 0:
        return 2.0, 0
    return float(counted[-min(_SHAKE_RANK, counted.size)]), counted.size


def _shake_signal(value: float, count: int) -> Signal:
    """shake's Signal from its value and the number of edge tiles it was chosen among."""
    if count == 0:
        return Signal(1.0, 2.0, "noise-free edge ratio (no edge tiles)")
    return Signal(_ramp(value, SHAKE_BAD, SHAKE_GOOD), value,
                  f"noise-free edge ratio, lowest direction, of {count} edge tiles")


def _shake_sums(plane: F32, th: int, tw: int, t: int) -> F32:
    """shake's squared first and second differences summed per tile, by numpy: (2, 4, t, t).
    Every other pixel of every other row (a tile keeps ~800 samples), read from the plane's four
    parity lattices, copied once into one buffer with a row stride of m + 1: every neighbour is
    one contiguous run (one loop per difference, not one per row); a row's last column steps
    into the next row and is never summed."""
    n, m, stride, size = th * t, tw * t, tw * t + 1, th * t * (tw * t + 1)
    lattices = np.empty((2, 2, (n + 1) * stride + 1), np.float32)
    lattices[:, :, -1] = 0.0  # a spare value: where a diagonal's last reach lands, never summed
    grid = plane[:2 * n + 2, :2 * m + 2].reshape(n + 1, 2, stride, 2)
    for a in (0, 1):
        np.copyto(lattices[a, :, :-1].reshape(2, n + 1, stride), grid[:, a].transpose(2, 0, 1))
    centre = lattices[1, 1, :size]
    twice = centre + centre
    k = len(_SHAKE_DIRECTIONS)
    diffs = np.empty((2 * k, size), np.float32)  # the first differences, then the second
    for d, (dy, dx) in enumerate(_SHAKE_DIRECTIONS):
        # neighbour (oy, ox) of (2i + 1, 2j + 1): lattice (1 - |oy|, 1 - |ox|), shifted 1 if = 1
        before, after = (lattices[1 - abs(oy), 1 - abs(ox)][
            (oy + 1) // 2 * stride + (ox + 1) // 2:][:size] for oy, ox in ((-dy, -dx), (dy, dx)))
        np.subtract(after, centre, out=diffs[d])
        np.add(after, before, out=diffs[k + d])
        diffs[k + d] -= twice
    np.square(diffs, out=diffs)
    out: F32 = tile_sums(diffs, stride, n, m, t).reshape(2, k, t, t)
    return out
