"""Test pictures with known properties, shared by the quality tests and its benchmark."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray


def scene(size: int = 224, seed: int = 0) -> NDArray[np.uint8]:
    """A sharp, well-exposed, clean RGB picture: a colour gradient, random solid rectangles and a
    checkered patch (axis-aligned edges: sharp for the Laplacian, silent for the noise mask)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size]
    img = 0.25 + 0.35 * (xx / size)[..., None] * np.array([1.0, 0.8, 0.6])
    for _ in range(12):
        y0, x0 = rng.integers(0, size - 40, 2)
        h, w = rng.integers(12, 60, 2)
        img[y0:y0 + h, x0:x0 + w] = rng.uniform(0.1, 0.9, 3)
    img[((yy // 8 + xx // 8) % 2 == 1) & (yy < 64) & (xx < 64)] = 0.85
    return np.asarray((img * 255).round(), np.uint8)
