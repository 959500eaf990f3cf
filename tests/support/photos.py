"""A real-photo evaluation set for the quality signals, shared by their tests and their bench.

The photographs are the ones scikit-image ships in its wheel (no download: the images that need
``pooch`` are left out). Each is resized to the model's input as a client would (short side to
224 px, bicubic with antialiasing, centre crop), plus seeded crops of it so the clean set is big
enough to measure a false-positive rate. ``page`` and ``text`` are documents, ``logo`` and
``colorwheel`` screenshot-like graphics: both are counted as clean.

The ``lfw_subset`` faces are 25 × 25 px: resized to 224 they are a resolution collapse of 9×
made by the world, not by us, so they are kept apart (``faces()``) and reported as such.

Every degradation is seeded and takes a severity; ``DEGRADATIONS`` lists the ladder of each and
the severity the source documents name (``source``). Images are uint8 H × W × 3 except the
NaN / wrong-range ones, which are float32 in [0, 1] as a v2 client would send them.
"""

from __future__ import annotations

import importlib
import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
from numpy.typing import NDArray
from PIL import Image

SIDE = 224
U8 = NDArray[np.uint8]
F32 = NDArray[np.float32]

# Real photographs in the wheel (camera, moon, coins, cell... are grey: replicated to RGB).
PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "camera", "motorcycle_left",
          "motorcycle_right", "coins", "grass", "gravel", "brick")
SCIENTIFIC = ("immunohistochemistry", "retina", "hubble_deep_field", "moon", "cell",
              "microaneurysms")
DOCUMENTS = ("page", "text")
SCREENSHOTS = ("logo", "colorwheel")
CROPS_PER_PHOTO = 8


@dataclass(frozen=True)
class Clean:
    name: str  # e.g. "chelsea" or "chelsea/crop2"
    kind: str  # photo | document | screenshot
    image: U8


def _skimage_data() -> Any:
    """scikit-image's data module (test extra; untyped), imported when a set is built."""
    return importlib.import_module("skimage.data")


def _load(name: str) -> U8:
    data = _skimage_data()
    if name.startswith("motorcycle_"):
        left, right, _ = data.stereo_motorcycle()
        raw = left if name.endswith("left") else right
    else:
        raw = getattr(data, name)()
    x = np.asarray(raw)
    if x.dtype == bool:
        x = x.astype(np.uint8) * 255
    if x.ndim == 2:
        x = np.repeat(x[..., None], 3, axis=2)
    if x.shape[2] == 4:  # RGBA on white, as a screenshot of it would look
        alpha = x[..., 3:4].astype(np.float32) / 255
        x = (x[..., :3] * alpha + 255 * (1 - alpha)).round()
    return np.asarray(x, np.uint8)


def _levelled(x: U8) -> U8:
    lo, hi = np.percentile(x, (2, 60))
    return np.asarray(np.clip((x - lo) / max(hi - lo, 1) * 255, 0, 255).round(), np.uint8)


def to_model_input(rgb: U8, box: tuple[int, int, int, int] | None = None) -> U8:
    """What a client sends: the short side resized to 224 (bicubic, antialiased), centre crop."""
    img = Image.fromarray(rgb)
    if box is not None:
        img = img.crop(box)
    w, h = img.size
    scale = SIDE / min(w, h)
    img = img.resize((max(SIDE, round(w * scale)), max(SIDE, round(h * scale))),
                     Image.Resampling.BICUBIC)
    w, h = img.size
    left, top = (w - SIDE) // 2, (h - SIDE) // 2
    return np.asarray(img.crop((left, top, left + SIDE, top + SIDE)), np.uint8)


@cache
def clean_set(crops: int = CROPS_PER_PHOTO, seed: int = 0) -> tuple[Clean, ...]:
    """Every clean image: each photo whole plus ``crops`` seeded crops (50-90 % of the short
    side), and the documents and screenshots whole."""
    rng = np.random.default_rng(seed)
    out: list[Clean] = []
    for name in (*PHOTOS, *SCIENTIFIC):
        raw = _load(name)
        kind = "photo" if name in PHOTOS else "scientific"
        out.append(Clean(name, kind, to_model_input(raw)))
        h, w = raw.shape[:2]
        for i in range(crops):
            side = int(min(h, w) * rng.uniform(0.5, 0.9))
            top, left = int(rng.integers(0, h - side + 1)), int(rng.integers(0, w - side + 1))
            out.append(Clean(f"{name}/crop{i}", kind,
                             to_model_input(raw, (left, top, left + side, top + side))))
    for kind, names in (("document", DOCUMENTS), ("screenshot", SCREENSHOTS)):
        out.extend(Clean(n, kind, to_model_input(_load(n))) for n in names)
    for n in DOCUMENTS:  # as a scanner with auto-levels sends it: paper white, ink black
        out.append(Clean(f"{n}/levelled", "document", to_model_input(_levelled(_load(n)))))
    return tuple(out)


def faces(count: int = 40) -> list[U8]:
    """``lfw_subset`` faces (25 × 25 px) resized to 224 as a client would: a real 9× collapse."""
    data = _skimage_data()
    stack = np.asarray(data.lfw_subset()[:count] * 255, np.float64).round().astype(np.uint8)
    return [to_model_input(np.repeat(f[..., None], 3, axis=2)) for f in stack]


# --- degradations -------------------------------------------------------------------------------


def _f(x: U8) -> NDArray[np.float64]:
    return x.astype(np.float64) / 255.0


def _u8(x: NDArray[np.float64]) -> U8:
    return np.asarray(np.clip(x * 255.0, 0, 255).round(), np.uint8)


def gaussian(x: U8, sigma: float, rng: np.random.Generator) -> U8:
    return _u8(_f(x) + rng.normal(0.0, sigma, x.shape))


def poisson(x: U8, lam: float, rng: np.random.Generator) -> U8:
    """Photon noise: each value is a count of photons at 1/lam photons for white, so its
    variance is lam · value (lam = 0.05: 20 photons at white)."""
    return _u8(rng.poisson(_f(x) / lam) * lam)


def low_light(x: U8, exposure: float, rng: np.random.Generator) -> U8:
    """Exposure cut to ``exposure`` of the original (values scaled; 0.1 = 10 %)."""
    return _u8(_f(x) * exposure)


def overexposure(x: U8, gain: float, rng: np.random.Generator) -> U8:
    """Too much light: values multiplied by ``gain`` and clipped at white."""
    return _u8(_f(x) * gain)


def gamma(x: U8, g: float, rng: np.random.Generator) -> U8:
    """A dark tone curve: value ** g (mid-tones sink, white stays white)."""
    return _u8(_f(x) ** g)


def _convolve(x: U8, kernel: NDArray[np.float64]) -> U8:
    convolve = importlib.import_module("scipy.ndimage").convolve  # skimage's dependency
    k = kernel / kernel.sum()
    return _u8(np.stack([convolve(_f(x)[..., c], k, mode="reflect") for c in range(3)], -1))


def defocus(x: U8, radius: float, rng: np.random.Generator) -> U8:
    """A lens out of focus: a uniform disk of ``radius`` px."""
    r = int(np.ceil(radius))
    yy, xx = np.mgrid[-r:r + 1, -r:r + 1]
    return _convolve(x, (xx ** 2 + yy ** 2 <= radius ** 2 + 0.5).astype(np.float64))


def motion(x: U8, length: float, rng: np.random.Generator) -> U8:
    """Camera shake: a line of ``length`` px at a seeded angle."""
    n = int(length) | 1
    angle = rng.uniform(0, np.pi)
    k = np.zeros((n, n))
    c = n // 2
    for t in np.linspace(-c, c, 4 * n):
        k[int(np.rint(c + t * np.sin(angle))), int(np.rint(c + t * np.cos(angle)))] = 1.0
    return _convolve(x, k)


def collapse(x: U8, factor: float, rng: np.random.Generator) -> U8:
    """Resolution collapse: down by ``factor`` (8.7 ≈ 2048×1536 → 224×224), then up again."""
    small = max(2, round(SIDE / factor))
    img = Image.fromarray(x).resize((small, small), Image.Resampling.BICUBIC)
    return np.asarray(img.resize((SIDE, SIDE), Image.Resampling.BICUBIC), np.uint8)


def jpeg(x: U8, quality: float, rng: np.random.Generator) -> U8:
    buf = io.BytesIO()
    Image.fromarray(x).save(buf, "JPEG", quality=int(quality))
    return np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"), np.uint8)


def ghost(x: U8, opacity: float, rng: np.random.Generator) -> U8:
    """OCR / video residue: a trace of another frame (a seeded other photo) at ``opacity``."""
    photos = [c.image for c in clean_set() if c.kind == "photo"]
    other = photos[int(rng.integers(len(photos)))]
    return _u8((1 - opacity) * _f(x) + opacity * _f(other))


def perspective(x: U8, strength: float, rng: np.random.Generator) -> U8:
    """A phone photo of a screen: corners moved inwards by up to ``strength`` of the side, the
    outside filled dark (the bezel)."""
    d = strength * SIDE
    quad = [(rng.uniform(0, d), rng.uniform(0, d)), (rng.uniform(0, d), SIDE - rng.uniform(0, d)),
            (SIDE - rng.uniform(0, d), SIDE - rng.uniform(0, d)),
            (SIDE - rng.uniform(0, d), rng.uniform(0, d))]
    src = [(0, 0), (0, SIDE), (SIDE, SIDE), (SIDE, 0)]
    # PIL maps output → input: solve for the coefficients sending quad (out) to src (in).
    a = []
    b = []
    for (u, v), (p, q) in zip(quad, src, strict=True):
        a.append([u, v, 1, 0, 0, 0, -p * u, -p * v])
        a.append([0, 0, 0, u, v, 1, -q * u, -q * v])
        b += [p, q]
    coeffs = np.linalg.solve(np.asarray(a, np.float64), np.asarray(b, np.float64))
    img = Image.fromarray(x).transform((SIDE, SIDE), Image.Transform.PERSPECTIVE,
                                       tuple(coeffs.tolist()), Image.Resampling.BICUBIC,
                                       fillcolor=(12, 12, 12))
    return np.asarray(img, np.uint8)


def nan(x: U8, share: float, rng: np.random.Generator) -> F32:
    """FP16 overflow as it reaches a model: a share of pixels NaN, in a float [0, 1] tensor."""
    out = np.asarray(_f(x), np.float32)
    mask = rng.random(x.shape[:2]) < share
    out[mask] = np.nan
    return out


def wrong_range(x: U8, scale: float, rng: np.random.Generator) -> F32:
    """A [0, 255] image sent to a model that expects [0, 1] (scale 255), or a [-1, 1] one
    (scale -1: values mapped to [-1, 1])."""
    f = np.asarray(_f(x), np.float32)
    return f * 2 - 1 if scale < 0 else f * np.float32(scale)


@dataclass(frozen=True)
class Degradation:
    name: str
    apply: Callable[[U8, float, np.random.Generator], U8 | F32]
    ladder: tuple[float, ...]
    source: float  # the severity the source documents name
    signal: str  # the signal meant to catch it ("" when none is)
    unit: str


DEGRADATIONS = (
    Degradation("gaussian", gaussian, (0.02, 0.04, 0.06, 0.08), 0.08, "noise", "sigma"),
    Degradation("poisson", poisson, (0.01, 0.02, 0.05), 0.05, "noise", "lambda"),
    Degradation("low_light", low_light, (0.5, 0.3, 0.2, 0.1), 0.1, "exposure", "exposure"),
    Degradation("gamma", gamma, (1.5, 2.2, 3.0), 3.0, "exposure", "gamma"),
    Degradation("overexposure", overexposure, (1.5, 2.0, 3.0), 2.0, "exposure", "gain"),
    Degradation("defocus", defocus, (1.0, 2.0, 3.0, 4.0), 3.0, "sharpness", "radius px"),
    Degradation("motion", motion, (5, 9, 15), 9, "sharpness", "length px"),
    Degradation("collapse", collapse, (2.0, 4.0, 8.7), 8.7, "sharpness", "factor"),
    Degradation("jpeg", jpeg, (30, 20, 10), 10, "blockiness", "quality"),
    Degradation("ghost", ghost, (0.05, 0.10, 0.15), 0.15, "", "opacity"),
    Degradation("perspective", perspective, (0.1, 0.2, 0.3), 0.2, "", "corner shift"),
    Degradation("nan", nan, (0.001, 0.01), 0.001, "finite", "share"),
    Degradation("wrong_range", wrong_range, (255.0, -1.0), 255.0, "range", "scale"),
)
BY_NAME = {d.name: d for d in DEGRADATIONS}


def degraded(d: Degradation, severity: float, seed: int = 0,
             kinds: tuple[str, ...] = ("photo",)) -> Iterator[tuple[Clean, U8 | F32]]:
    """(clean source, degraded copy) for every clean image of ``kinds``; seeded per image."""
    for i, c in enumerate(clean_set()):
        if c.kind in kinds:
            rng = np.random.default_rng([seed, i, int(abs(severity) * 1000)])
            yield c, d.apply(c.image, severity, rng)
