"""A faint copy of another image of the same request over an image: a scanned page that carries
the page before it, a video frame with the last one left in it (the seeds' "OCR residue"),
an unrelated picture blended in. ``residue`` compares each image with the few before it.

One image alone cannot tell a faint overlay of another scene from its own texture
(docs/quality.md, Round 16: AUC 0.50); told which picture to look for, one correlation does. The
evidence is the sign of the Laplacian (where each picture's edges bend which way): a copy at 5 %
leaves its signs in the image it lies over, so the two images' signs agree more often than two
unrelated pictures' ever do (0.02 and up against at most 0.016 on the evaluation's pairs). Two
frames of one scene agree too, and more: they are told apart by their coarse luminance (8 × 8
block means), which two frames of one scene share (0.9 and up) and an image with a faint layer
does not share with that layer; and a copy lies over the whole frame, so no region of the
frame disagrees (a scene that moved agrees in some regions and disagrees in others).

Only images of one request, of one client's gRPC stream (``stream_frames``: a video sent
frame by frame), or of one client a trusted gateway names (``listeners.*.client_header``) are
compared, each with the ``WINDOW`` images before it: nothing else links two requests, so no
client's score can depend on another client's images.

Rules that MUST hold: the score is finite and in [0, 1]; an image with a copy of an earlier image
of the request laid over it never scores above the same image without it, on the evaluation's
pairs; two unrelated pictures, and two frames of one scene, score 1.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from numpy.typing import NDArray

from filters.quality.measure import F32, LAPLACIAN_FLAT, Signal, laplacian
from filters.quality.measure import ramp as _ramp

RESIDUE_BAD, RESIDUE_GOOD = 0.03, 0.01  # the signs' correlation; see residue()
SAME_SCENE = 0.9  # coarse luminance correlation: at or above, two frames of one scene
REGION_FLOOR = -0.01  # every region's sign correlation above this: the copy covers the frame
IDENTICAL = 0.95  # a region's sign correlation: at or above, the same picture there
WINDOW = 4  # each image is compared with this many images before it
_REGIONS = 3  # a 3 × 3 grid
_BLOCK = 8  # px: the coarse luminance's blocks
_MIN_SIDE = 32
STREAM_BYTES = 64 << 20
"""What one mmguard process keeps at most of streams' earlier frames (~55 KB an image at
224 px, the last ``WINDOW`` of a stream: ~220 KB a stream; 64 MiB is ~300 streams). A stream
that finds it spent keeps nothing and says so (``unscored``)."""


@dataclass(frozen=True, slots=True)
class Trace:
    """What ``residue`` compares of one image's luminance plane, made once per image: its
    Laplacian's signs region by region (a 3 × 3 grid; the last row or two and column or two
    that the grid does not divide are left out), with each region's sum and count of signs,
    and its coarse luminance (8 × 8 block means), centred and scaled to unit energy."""

    shape: tuple[int, int]
    signs: NDArray[np.float32] | NDArray[np.int8]  # (9, region's pixels): -1, 0 or 1
    sums: NDArray[np.float64]  # per region: the sum of its signs
    counts: NDArray[np.float64]  # per region: its non-zero signs (the sum of their squares)
    coarse: NDArray[np.float64]


def trace(plane: F32) -> Trace | None:
    """The trace of a luminance plane (``luma.luminance``, ~224 px); None when it is too small
    or holds a NaN or an infinity (``finite`` speaks for those)."""
    h, w = plane.shape
    if min(h, w) < _MIN_SIDE:
        return None
    plane = np.ascontiguousarray(plane, np.float32)
    lap = laplacian(plane)
    if not np.isfinite(lap).all():
        return None
    rh, rw = (h - 2) // _REGIONS, (w - 2) // _REGIONS
    grid = lap[:rh * _REGIONS, :rw * _REGIONS].reshape(_REGIONS, rh, _REGIONS, rw)
    regions = np.ascontiguousarray(grid.transpose(0, 2, 1, 3)).reshape(_REGIONS ** 2, rh * rw)
    # Within rounding of zero, a flat patch's Laplacian has no sign: its noise would be read as
    # edges (the order of its summation decides it).
    up, down = regions > LAPLACIAN_FLAT, regions < -LAPLACIAN_FLAT
    signs = up.astype(np.float32)
    signs -= down
    sums = np.einsum("ij->i", signs).astype(np.float64)  # exact: integers under 2^24
    counts = np.einsum("ij,ij->i", signs, signs).astype(np.float64)
    bh, bw = h // _BLOCK, w // _BLOCK
    rows = np.einsum("ijk->ik", plane[:bh * _BLOCK, :bw * _BLOCK].reshape(bh, _BLOCK, -1))
    coarse = np.einsum("ijk->ij", rows.reshape(bh, bw, _BLOCK)).astype(np.float64).reshape(-1)
    coarse -= coarse.mean()
    energy = float(np.dot(coarse, coarse))
    if energy > 1e-12:
        coarse /= np.sqrt(energy)
    return Trace((h, w), signs, sums, counts, coarse)


@dataclass(frozen=True, slots=True)
class Overlap:
    """How two traces agree: their signs over the frame, the least and most of any region, and
    their coarse luminance."""

    signs: float
    least: float
    most: float
    coarse: float

    @property
    def copy(self) -> float:
        """The evidence of a faint copy: the signs' correlation where it spans the frame and the
        two are not one scene; 0 otherwise."""
        if self.coarse >= SAME_SCENE or self.most >= IDENTICAL or self.least <= REGION_FLOOR:
            return 0.0
        return max(self.signs, 0.0)


def _correlation(dot: float, n: float, sa: float, qa: float, sb: float, qb: float) -> float:
    """Pearson's correlation from the raw sums: Σab, n, Σa, Σa², Σb, Σb² (0 where one side is
    flat). Signs are -1, 0 or 1: every sum is an exact integer in float32 and in double."""
    var = (qa - sa * sa / n) * (qb - sb * sb / n)
    return (dot - sa * sb / n) / math.sqrt(var) if var > 1e-12 else 0.0


def overlap(a: Trace, b: Trace) -> Overlap | None:
    """How ``a`` and ``b`` agree; None when their planes differ in shape (nothing lies over
    the other pixel for pixel)."""
    if a.shape != b.shape:
        return None
    # A stream's kept traces hold their signs in int8: read in float32 as the fresh ones.
    xa, xb = (x if x.dtype == np.float32 else x.astype(np.float32) for x in (a.signs, b.signs))
    dots = np.einsum("ij,ij->i", xa, xb).tolist()
    n = float(a.signs.shape[1])
    sa, qa, sb, qb = a.sums.tolist(), a.counts.tolist(), b.sums.tolist(), b.counts.tolist()
    regions = [_correlation(dots[k], n, sa[k], qa[k], sb[k], qb[k]) for k in range(len(dots))]
    whole = _correlation(sum(dots), n * len(dots), sum(sa), sum(qa), sum(sb), sum(qb))
    return Overlap(whole, min(regions), max(regions), float(np.dot(a.coarse, b.coarse)))


def compact(t: Trace) -> Trace:
    """The trace as a stream keeps it: the same values, its signs in int8 (a quarter of the
    bytes)."""
    return replace(t, signs=t.signs.astype(np.int8))


def nbytes(t: Trace) -> int:
    return t.signs.nbytes + t.sums.nbytes + t.counts.nbytes + t.coarse.nbytes


class Budget:
    """Bytes lent to streams' and named clients' kept traces, process-wide; ``take`` refuses
    past the limit. ``watchers`` hear every change (the registries' gauges)."""

    def __init__(self, limit: int = STREAM_BYTES) -> None:
        self.limit = limit
        self.used = 0
        self.watchers: weakref.WeakKeyDictionary[Any, Callable[[int], None]] = (
            weakref.WeakKeyDictionary())
        """Registry → its gauge's ``set`` (a registry gone, its watcher goes)."""
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if self.used + n > self.limit:
                return False
            self.used += n
        self._tell()
        return True

    def give(self, n: int) -> None:
        with self._lock:
            self.used -= n
        self._tell()

    def _tell(self) -> None:
        for watch in list(self.watchers.values()):
            watch(self.used)


STREAMS = Budget()
"""The process's one budget for every route's kept frames."""


def residue(t: Trace | None, earlier: Iterable[tuple[str, Trace | None]]) -> Signal | None:
    """An image's ``residue`` signal against the images before it (``earlier``: at most
    ``WINDOW`` of them, each with its name for the message); None when none of them has its
    shape, or it has no trace.

    The signs' correlation with the earlier image that agrees most (the ``copy`` of
    ``Overlap``): 0.01 scores 1, 0.03 scores 0 (0.5, the 'screens' intent's rule, at 0.02:
    above every pair of unrelated pictures, documents and screenshots of the evaluation;
    docs/quality.md, Round 17). A faint layer is found in the later image of the two, whichever
    of them carries it.

    Known confusions: two frames of one scene whose coarse luminance changed (a light switched
    on, a fast pan over a texture that repeats, such as a brick wall) can read as a copy
    (0.4 % of the evaluation's same-scene pairs); two JPEGs with flat areas whose 8-px block
    edges agree (1 of 741 unrelated pairs at q75); a copy moved by more than a pixel against
    the earlier image is not seen (the ``ghosting`` signal reads a shifted copy of the image
    itself); a copy over a frame with flat regions (a sky) loses its evidence there."""
    if t is None:
        return None
    best: tuple[float, str] | None = None
    for name, e in earlier:
        found = overlap(t, e) if e is not None else None
        if found is not None and (best is None or found.copy > best[0]):
            best = (found.copy, name)
    if best is None:
        return None
    value, name = best
    return Signal(_ramp(value, RESIDUE_BAD, RESIDUE_GOOD), value,
                  f"edge-sign correlation with {name}, the earlier image it agrees with most")


def residues(traces: Sequence[Trace | None], names: Sequence[str]) -> list[Signal | None]:
    """Each image's ``residue`` against the ``WINDOW`` images before it in ``traces``."""
    return [residue(t, [(names[i], traces[i]) for i in range(max(0, j - WINDOW), j)])
            for j, t in enumerate(traces)]
