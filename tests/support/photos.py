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
import importlib.util
import io
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
from numpy.typing import NDArray
from PIL import Image, ImageDraw, ImageFilter

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


# --- beyond the evaluation framing (docs/quality.md, "Framings and kinds") ------------------------

# What matplotlib ships in its wheel (mpl-data/sample_data; the test extra): Grace Hopper's
# portrait (a real photograph, US Navy, public domain), a rendered gift-pack icon (clip art,
# Minduka, CC BY-SA) and matplotlib's logo: illustrations.
MPL_PHOTOS = ("grace_hopper.jpg",)
MPL_ILLUSTRATIONS = ("Minduka_Present_Blue_Pack.png", "logo2.png")
ILLUSTRATIONS = ("horse", "checkerboard", "logo")  # scikit-image: silhouette, pattern, logo


def _load_mpl(name: str) -> U8:
    base = importlib.import_module("matplotlib").get_data_path()
    img: Image.Image = Image.open(f"{base}/sample_data/{name}")
    if img.mode in ("RGBA", "LA", "P"):
        white = Image.new("RGBA", img.size, (255, 255, 255, 255))
        img = Image.alpha_composite(white, img.convert("RGBA"))
    return np.asarray(img.convert("RGB"), np.uint8)


# What scikit-learn ships in its wheel (sklearn/datasets/images; the test extra): two real
# photographs, a Chinese temple and a flower (danielbuechele and vultilion on Flickr, CC BY 2.0,
# per the folder's README.txt). Read from the files, without importing scikit-learn.
SKLEARN_PHOTOS = ("china.jpg", "flower.jpg")


def _load_sklearn(name: str) -> U8:
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("scikit-learn (the test extra) ships china.jpg and flower.jpg")
    base = next(iter(spec.submodule_search_locations))
    with Image.open(f"{base}/datasets/images/{name}") as img:
        return np.asarray(img.convert("RGB"), np.uint8)


def _source(name: str) -> U8:
    if name in SKLEARN_PHOTOS:
        return _load_sklearn(name)
    return _load_mpl(name) if "." in name else _load(name)


_WORDS = ("lorem", "ipsum", "dolor", "sit", "amet", "elit", "sed", "do")


def screenshots(count: int = 8, seed: int = 0) -> list[tuple[str, U8]]:
    """Rendered user interfaces (light and dark mode: a title bar, text lines, buttons, a photo
    thumbnail), at 224 × 224 as a client sends a screenshot: synthetic, seeded."""
    from PIL import ImageDraw
    rng = np.random.default_rng(seed)
    thumb = Image.fromarray(_load("chelsea")).resize((72, 54))
    out = []
    for i in range(count):
        dark = i % 2 == 1
        bg, fg = ((30, 30, 34), (220, 220, 220)) if dark else ((250, 250, 250), (30, 30, 30))
        img = Image.new("RGB", (448, 448), bg)
        draw = ImageDraw.Draw(img)
        accent = tuple(int(v) for v in rng.integers(40, 220, 3))
        draw.rectangle((0, 0, 448, 36), fill=accent)
        y = 50
        while y < 420:
            if rng.random() < 0.15:
                draw.rounded_rectangle((20, y, 140, y + 28), 6, fill=accent)
                draw.text((32, y + 8), "Submit", fill=(255, 255, 255))
                y += 40
            elif rng.random() < 0.1:
                img.paste(thumb.resize((144, 108)), (20, y))
                y += 118
            else:
                words = " ".join(_WORDS[: int(rng.integers(3, 8))])
                draw.text((20, y), words, fill=fg)
                y += 18
        out.append((f"ui{i}{'-dark' if dark else ''}", np.asarray(
            img.resize((SIDE, SIDE), Image.Resampling.LANCZOS), np.uint8)))
    return out


def kind_sources() -> dict[str, list[str]]:
    """Every source image by kind (screenshots are rendered: ``screenshots()``)."""
    return {"photo": [*PHOTOS, *MPL_PHOTOS, *SKLEARN_PHOTOS], "scientific": list(SCIENTIFIC),
            "document": list(DOCUMENTS), "illustration": [*ILLUSTRATIONS, *MPL_ILLUSTRATIONS]}


@cache
def random_crops(per_photo: int = 12, seed: int = 1) -> tuple[Clean, ...]:
    """Random crops of the photographs, 25-60 % of the short side at a random place (a user's
    tight framing: a face, a part of a scene, often on an out-of-focus background), never under
    224 source pixels: a smaller crop would be up-scaled, a resolution collapse of its own that
    the sharpness signal is right to flag (these sources are 300-640 px; a phone's are 4000)."""
    rng = np.random.default_rng(seed)
    out = []
    for name in kind_sources()["photo"]:
        raw = _source(name)
        h, w = raw.shape[:2]
        for i in range(per_photo):
            side = min(max(int(min(h, w) * rng.uniform(0.25, 0.6)), SIDE), min(h, w))
            top, left = int(rng.integers(0, h - side + 1)), int(rng.integers(0, w - side + 1))
            out.append(Clean(f"{name}/rand{i}", "photo",
                             to_model_input(raw, (left, top, left + side, top + side))))
    return tuple(out)


@cache
def whole_frames() -> tuple[Clean, ...]:
    """Every source of every kind, the whole frame squeezed to 224 × 224 (no crop: a client
    that resizes without keeping the aspect), and the rendered screenshots."""
    out = []
    for kind, names in kind_sources().items():
        for name in names:
            img = Image.fromarray(_source(name)).resize((SIDE, SIDE), Image.Resampling.BICUBIC)
            out.append(Clean(name, kind, np.asarray(img, np.uint8)))
    out.extend(Clean(n, "screenshot", x) for n, x in screenshots())
    return tuple(out)


@cache
def high_key() -> tuple[Clean, ...]:
    """Clean pictures bright by nature, made from the photographs (no package ships a real
    one): a white product shot and a snow field per photograph.

    - ``/product``: the photograph at 60 % of the frame on a white seamless backdrop (blown
      white where the light falls, 0.92 towards the corners) with a soft shadow under it: a
      correctly exposed subject on clipped white.
    - ``/snow``: the photograph's luminance texture, its 1st-99th percentile mapped onto
      0.72-1.04 and clipped, tinted a little blue: most pixels bright, the brightest few
      percent at white, no dark tones (an offset and a squeeze, not a gain)."""
    out = []
    yy, xx = np.mgrid[0:SIDE, 0:SIDE].astype(np.float64) / (SIDE - 1) - 0.5
    backdrop = np.clip(1.06 - 0.55 * (xx ** 2 + yy ** 2), 0.92, 1.0)
    shadow_mask = Image.new("L", (SIDE, SIDE), 0)
    side = int(0.6 * SIDE)
    top = (SIDE - side) // 2
    ImageDraw.Draw(shadow_mask).ellipse((top - 6, top + side - 8, top + side + 6, top + side + 14),
                                        fill=255)
    shadow = np.asarray(shadow_mask.filter(ImageFilter.GaussianBlur(7)), np.float64) / 255
    for name in kind_sources()["photo"]:
        small = np.asarray(Image.fromarray(to_model_input(_source(name))).resize(
            (side, side), Image.Resampling.BICUBIC), np.float64) / 255
        bg = (backdrop * (1 - 0.18 * shadow))[..., None].repeat(3, axis=2)
        bg[top:top + side, top:top + side] = small
        out.append(Clean(f"{name}/product", "high-key", _u8(bg)))
        lum = _f(to_model_input(_source(name))) @ np.array([0.299, 0.587, 0.114])
        lo, hi = np.percentile(lum, (1, 99))
        snow = 0.72 + 0.32 * np.clip((lum - lo) / max(hi - lo, 1e-6), 0, 1)
        out.append(Clean(f"{name}/snow", "high-key",
                         _u8(snow[..., None] * np.array([0.97, 0.99, 1.0]))))
    return tuple(out)


def camera_shake() -> list[tuple[str, U8]]:
    """A real camera shake: scikit-image's wall clock, photographed while moving the camera
    sideways (Stefan van der Walt, public domain), whole and in four corner crops of 60 % of
    its short side, as a client would send them. Reported apart, like ``faces``."""
    raw = _load("clock")
    h, w = raw.shape[:2]
    side = int(0.6 * min(h, w))
    boxes = [None, (0, 0, side, side), (w - side, 0, w, side), (0, h - side, side, h),
             (w - side, h - side, w, h)]
    return [(f"clock/{i}", to_model_input(raw, box)) for i, box in enumerate(boxes)]


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
    """A tone curve value ** g: dark above 1 (mid-tones sink, white stays white), bright
    below 1 (mid-tones rise towards white, black stays black: washed out, nothing clipped)."""
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


def _line(x: U8, length: float, angle: float) -> U8:
    n = int(length) | 1
    k = np.zeros((n, n))
    c = n // 2
    for t in np.linspace(-c, c, 4 * n):
        k[int(np.rint(c + t * np.sin(angle))), int(np.rint(c + t * np.cos(angle)))] = 1.0
    return _convolve(x, k)


def motion(x: U8, length: float, rng: np.random.Generator) -> U8:
    """Camera shake: a line of ``length`` px at a seeded angle."""
    return _line(x, length, rng.uniform(0, np.pi))


def motion_angle(x: U8, degrees: float, rng: np.random.Generator) -> U8:
    """Camera shake of 9 px at a fixed angle (0 = along the rows), then sensor noise as a
    camera adds it after the optics (Gaussian, σ 0.004 of white: the clean photographs'
    median noise estimate; the real clock reads 0.002), which the blur does not smooth."""
    blurred = _line(x, 9, np.radians(degrees))
    return _u8(_f(blurred) + rng.normal(0.0, 0.004, x.shape))


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
    """OCR residue, a previous video frame, a double exposure: the frame over itself shifted
    by 4-24 px in a seeded direction, at ``opacity``."""
    angle, r = rng.uniform(0, 2 * np.pi), rng.uniform(4, 24)
    dy, dx = round(r * np.sin(angle)), round(r * np.cos(angle))
    h, w = x.shape[:2]
    ys, xs = np.clip(np.arange(h) - dy, 0, h - 1), np.clip(np.arange(w) - dx, 0, w - 1)
    return _u8((1 - opacity) * _f(x) + opacity * _f(x[ys][:, xs]))


def overlay(x: U8, opacity: float, rng: np.random.Generator) -> U8:
    """A trace of another scene (a seeded other photo) at ``opacity``."""
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
    return _warp(x, quad, [(0, 0), (0, SIDE), (SIDE, SIDE), (SIDE, 0)])


def keystone(x: U8, strength: float, rng: np.random.Generator) -> U8:
    """A phone photo of a screen that fills the frame, taken at an angle: no bezel in view,
    the picture itself keystoned. The frame shows a quadrilateral of the picture whose corners
    are moved inwards by up to ``strength`` of the side (one side's pair by more: the near and
    far edges of a tilted screen), stretched to the whole frame."""
    d = strength * SIDE
    near = rng.integers(4)  # the side seen from closest: its corners move in least
    moved = [rng.uniform(0.5, 1.0) * d for _ in range(4)]
    for i in (near, (near + 1) % 4):
        moved[i] *= 0.2
    corners = [(0, 0), (0, SIDE), (SIDE, SIDE), (SIDE, 0)]
    quad = [(u + m * np.sign(SIDE / 2 - u), v + m * np.sign(SIDE / 2 - v))
            for (u, v), m in zip(corners, moved, strict=True)]
    return _warp(x, corners, quad)


def _warp(x: U8, out: Sequence[tuple[float, float]], into: Sequence[tuple[float, float]]) -> U8:
    """The perspective transform sending quadrilateral ``out`` of the output to ``into`` of
    the input (PIL maps output to input), the outside filled dark (a bezel)."""
    a = []
    b = []
    for (u, v), (p, q) in zip(out, into, strict=True):
        a.append([u, v, 1, 0, 0, 0, -p * u, -p * v])
        a.append([0, 0, 0, u, v, 1, -q * u, -q * v])
        b += [p, q]
    coeffs = np.linalg.solve(np.asarray(a, np.float64), np.asarray(b, np.float64))
    img = Image.fromarray(x).transform((SIDE, SIDE), Image.Transform.PERSPECTIVE,
                                       tuple(coeffs.tolist()), Image.Resampling.BICUBIC,
                                       fillcolor=(12, 12, 12))
    return np.asarray(img, np.uint8)


def moire(x: U8, contrast: float, rng: np.random.Generator) -> U8:
    """A phone photo of a screen that fills the frame: the picture shown on a screen whose
    pixels are separated by a dark matrix (``contrast``: how dark, 0-1), sampled by a sensor
    of 4 × the model's resolution whose pixels (aperture 0.4 px) are almost the screen's
    pitch, then resized to the model's input as a client would. The screen's grid is off
    the sensor's by a seeded beat of 5-30 output px in a seeded direction: that beat is the
    moiré; the grid itself is above the sensor's resolution and aliases into it."""
    up = 4
    h, w = x.shape[:2]
    big = np.asarray(Image.fromarray(x).resize((w * up, h * up), Image.Resampling.BICUBIC),
                     np.float64) / 255.0
    angle = rng.uniform(0, 2 * np.pi)
    beat = np.array([np.cos(angle), np.sin(angle)]) / (rng.uniform(5, 30) * up)
    k1 = np.array([1.0, 0.0]) + beat  # cycles per sensor px: one screen pixel per sensor pixel
    k2 = np.array([-k1[1], k1[0]])  # the grid's other direction, at right angles
    yy, xx = np.mgrid[0:h * up, 0:w * up].astype(np.float64)
    mask = np.zeros_like(xx)
    for oy in (-0.2, 0.2):  # the sensor pixel's aperture: four points 0.4 px apart
        for ox in (-0.2, 0.2):
            u = (xx + ox) * k1[0] + (yy + oy) * k1[1]
            v = (xx + ox) * k2[0] + (yy + oy) * k2[1]
            mask += ((1 - contrast * (0.5 + 0.5 * np.cos(2 * np.pi * u)) ** 2)
                     * (1 - contrast * (0.5 + 0.5 * np.cos(2 * np.pi * v)) ** 2))
    shot = big * (mask / mask.mean())[..., None]
    return np.asarray(Image.fromarray(_u8(shot)).resize((w, h), Image.Resampling.BICUBIC),
                      np.uint8)


def keystone_moire(x: U8, strength: float, rng: np.random.Generator) -> U8:
    """A phone photo of a screen that fills the frame, taken at an angle, with its moiré: the
    moiré of grid contrast 0.4 (``moire``), then keystoned by ``strength`` (``keystone``): the
    screen's pitch, so the beat's period, now changes across the frame (a chirp)."""
    return keystone(moire(x, 0.4, rng), strength, rng)


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
    Degradation("defocus", defocus, (1.0, 2.0, 3.0, 4.0), 3.0, "sharpness", "radius px"),
    Degradation("motion", motion, (5, 9, 15), 9, "sharpness", "length px"),
    Degradation("motion_angle", motion_angle, (0.0, 22.5, 45.0, 90.0), 0.0, "shake",
                "degrees, 9 px + noise"),
    Degradation("collapse", collapse, (2.0, 4.0, 8.7), 8.7, "sharpness", "factor"),
    Degradation("jpeg", jpeg, (30, 20, 10), 10, "blockiness", "quality"),
    Degradation("gamma", gamma, (1.5, 2.2, 3.0), 3.0, "tone", "gamma"),
    Degradation("bright_gamma", gamma, (0.7, 0.5, 0.33), 0.5, "washout", "gamma"),
    Degradation("overexposure", overexposure, (1.5, 2.0, 3.0), 2.0, "exposure", "gain"),
    Degradation("ghost", ghost, (0.05, 0.10, 0.15, 0.25), 0.15, "ghosting", "opacity"),
    Degradation("overlay", overlay, (0.05, 0.10, 0.15), 0.15, "", "opacity"),
    Degradation("perspective", perspective, (0.1, 0.2, 0.3), 0.2, "perspective", "corner shift"),
    Degradation("keystone", keystone, (0.1, 0.2, 0.3), 0.2, "", "corner shift"),  # nor this
    Degradation("moire", moire, (0.1, 0.2, 0.4, 0.7), 0.4, "moire", "grid contrast"),
    Degradation("keystone_moire", keystone_moire, (0.1, 0.2, 0.3), 0.2, "moire",
                "corner shift, moiré 0.4"),
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
