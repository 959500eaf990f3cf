"""Seeded input perturbations: what the fault filter injects into canary traffic.

Guards against a model (or a new model version) that looks healthy on clean traffic only: the
canary gets the seeds' degraded inputs (Gaussian σ = 0.08 low-light noise, ε = 0.03 FGSM/PGD,
25 % of the patches masked, an occluding block over 20 % of the frame, 15 % of the tokens
dropped, FP16/BF16 precision collapse, blur, darkness, mixed scripts, cut text) and its answers
are compared with the primary's on the clean input.

Rules that MUST hold, for every function here:

* Randomness comes only from the ``rng`` argument (a ``numpy.random.Generator``): the same seed
  gives byte-identical output; how much of the stream a call consumes depends only on the
  input's shape (and, for text, its words or letters), never on the values.
* The input is never modified in place; the result is a new array of the same dtype and shape
  (``token_dropout`` keeps the shape too: it pads where it removed).
* Images are float arrays (float16, float32, float64) shaped [..., H, W], e.g. [N, C, H, W] or
  [C, H, W], with pixels in [lo, hi] (default [0, 1]); arithmetic runs in float32 (float64 for
  float64 input) and additive perturbations are clamped to [lo, hi] before the cast back.
* Token ids are integer arrays [..., T], e.g. [N, T] or [T]; ``pad_id`` marks padding.
* Bad arguments raise ``ValueError`` naming the argument, what was expected and what came.

Dropping a whole modality is the caller's job (it removes the tensor); nothing here does it.
torch is needed only by :func:`fgsm` and :func:`load_surrogate` and is imported inside them.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

import ml_dtypes
import numpy as np
from numpy.typing import NDArray

# The seed scenarios' figures (the callers' defaults).
SIGMA_LOW_LIGHT = 0.08
SIGMA_CROSS_MODAL = 0.01
EPS_ADVERSARIAL = 0.03
MASK_RATIO = 0.25
OCCLUSION_AREA = 0.20
TOKEN_DROP_P = 0.15

FloatT = TypeVar("FloatT", bound=np.floating[Any])
IntT = TypeVar("IntT", bound=np.integer[Any])

# A gradient surrogate: ``surrogate(image)`` or ``surrogate(image, target)`` -> a scalar
# torch.Tensor, the loss to INCREASE. Typed loosely so torch stays an optional import.
Surrogate = Callable[..., Any]

_TORCH_HINT = "pip install 'mmguard[torch]'"


# --- argument checks ----------------------------------------------------------------------------


def _image(x: NDArray[Any], name: str = "x") -> None:
    if not isinstance(x, np.ndarray) or x.dtype not in (np.float16, np.float32, np.float64):
        got = x.dtype if isinstance(x, np.ndarray) else type(x).__name__
        raise ValueError(f"{name}: expected a float16/float32/float64 numpy array, got {got}")
    if x.ndim < 2:
        raise ValueError(f"{name}: expected an image with at least 2 dimensions (..., H, W), "
                         f"got shape {x.shape}")


def _ids(ids: NDArray[Any]) -> None:
    if not isinstance(ids, np.ndarray) or not np.issubdtype(ids.dtype, np.integer):
        got = ids.dtype if isinstance(ids, np.ndarray) else type(ids).__name__
        raise ValueError(f"ids: expected an integer numpy array [..., T], got {got}")
    if ids.ndim < 1:
        raise ValueError(f"ids: expected at least 1 dimension [..., T], got shape {ids.shape}")


def _real(value: object) -> bool:
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)


def _at_least(name: str, value: float, low: float) -> None:
    if not (_real(value) and math.isfinite(value) and value >= low):
        raise ValueError(f"{name}: expected a finite number >= {low}, got {value!r}")


def _share(name: str, value: float) -> None:
    if not (_real(value) and 0.0 <= value <= 1.0):
        raise ValueError(f"{name}: expected a number in [0, 1], got {value!r}")


def _whole(name: str, value: int, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")


def _bounds(lo: float, hi: float) -> None:
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError(f"lo, hi: expected finite bounds with lo < hi, got lo={lo!r}, hi={hi!r}")


def _work(x: NDArray[Any]) -> type[np.floating[Any]]:
    """The dtype arithmetic runs in: float16 is widened, float64 kept."""
    return np.float64 if x.dtype == np.float64 else np.float32


def _count(share: float, n: int) -> int:
    """How many of ``n`` things a share means (round half up, so 0.5 of 3 is 2)."""
    return min(n, math.floor(share * n + 0.5))


# --- additive noise -----------------------------------------------------------------------------


def gaussian_noise(x: NDArray[FloatT], sigma: float, rng: np.random.Generator,
                   lo: float = 0.0, hi: float = 1.0) -> NDArray[FloatT]:
    """``x`` plus N(0, σ²) noise per element, clamped to [lo, hi]. Seeds: σ = 0.08 (low light,
    PSNR ~22 dB), σ = 0.01 (cross-modal)."""
    _image(x)
    _at_least("sigma", sigma, 0.0)
    _bounds(lo, hi)
    work = _work(x)
    y = rng.standard_normal(x.shape, dtype=work)
    y *= sigma
    y += x
    return np.clip(y, lo, hi, out=y).astype(x.dtype)


def sign_noise(x: NDArray[FloatT], eps: float, rng: np.random.Generator,
               lo: float = 0.0, hi: float = 1.0) -> NDArray[FloatT]:
    """``x + eps · s`` with a random sign ``s`` = ±1 per element (the sign of a standard normal,
    drawn directly as a fair coin), clamped: FGSM's L∞ shape without a gradient. Seed ε = 0.03."""
    _image(x)
    _at_least("eps", eps, 0.0)
    _bounds(lo, hi)
    work = _work(x)
    y = rng.integers(0, 2, x.shape, dtype=np.int8).astype(work)
    y *= 2 * eps
    y += x
    y -= eps
    return np.clip(y, lo, hi, out=y).astype(x.dtype)


# --- gradient attacks (torch) ------------------------------------------------------------------


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise RuntimeError(f"gradient perturbations (fgsm, load_surrogate) need torch: "
                           f"{_TORCH_HINT}") from exc
    return torch


def load_surrogate(path: str, mode: str = "lower", device: str = "cpu") -> Surrogate:
    """Load a TorchScript module (``torch.jit.save``) as a loss for :func:`fgsm`.

    ``forward(image[, target])`` returns a scalar or a tensor (reduced with ``.mean()``). The
    returned callable gives ``-forward(...).mean()`` for ``mode="lower"`` (the attack lowers the
    output, e.g. an image-text similarity) and ``+forward(...).mean()`` for ``mode="raise"``.
    The module is loaded onto ``device`` in eval mode; the image is moved there per call.
    """
    torch = _torch()
    if mode not in ("lower", "raise"):
        raise ValueError(f"mode: expected 'lower' or 'raise', got {mode!r}")
    if not Path(path).is_file():
        raise ValueError(f"path: expected a TorchScript file, got {path!r} (no such file)")
    with warnings.catch_warnings():
        # TorchScript is the surrogate format callers ship; torch marks jit.load deprecated.
        warnings.filterwarnings("ignore", r".*torch\.jit\.load.* deprecated", DeprecationWarning)
        module = torch.jit.load(path, map_location=device)
    module.eval()
    sign = -1.0 if mode == "lower" else 1.0

    def loss(image: Any, *target: Any) -> Any:
        return sign * module(image.to(device), *target).mean()

    return loss


def _gradient(torch: Any, surrogate: Surrogate, image: NDArray[Any],
              target: Any) -> NDArray[np.float32]:
    t = torch.from_numpy(np.array(image, dtype=np.float32)).requires_grad_(True)
    with torch.enable_grad():
        loss = surrogate(t) if target is None else surrogate(t, target)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"surrogate: expected a scalar torch loss, got "
                             f"{getattr(loss, 'shape', type(loss).__name__)}")
        if not loss.requires_grad:
            raise ValueError("surrogate: expected a loss that depends on the image, got one "
                             "without a gradient")
        (grad,) = torch.autograd.grad(loss.reshape(()), t)
    return np.asarray(grad.detach().cpu().numpy(), np.float32)


def fgsm(x: NDArray[FloatT], eps: float, surrogate: Surrogate, target: Any = None,
         steps: int = 1, alpha: float | None = None, lo: float = 0.0,
         hi: float = 1.0) -> NDArray[FloatT]:
    """FGSM (``steps=1``) or PGD (``steps>1``) in the L∞ ball of radius ``eps`` around ``x``.

    Each step moves ``alpha · sign(∇ loss)`` (``alpha`` defaults to ``eps`` for one step,
    ``eps / 4`` for several), then projects back into the ball and into [lo, hi]. PGD starts at
    ``x`` itself (no random start), so the result is deterministic and needs no rng.

    ``surrogate`` is called as ``surrogate(image)`` (or ``surrogate(image, target)`` when
    ``target`` is not None: e.g. the text embedding whose similarity the attack lowers) with a
    float32 CPU torch tensor shaped like ``x`` that requires grad, and returns the scalar loss to
    INCREASE (:func:`load_surrogate` builds one from a TorchScript file). Only the gradient
    goes through torch; the steps run in numpy in ``x``'s working dtype.
    """
    _image(x)
    _at_least("eps", eps, 0.0)
    _whole("steps", steps, 1)
    if alpha is None:
        alpha = eps if steps == 1 else eps / 4
    _at_least("alpha", alpha, 0.0)
    _bounds(lo, hi)
    if not callable(surrogate):
        raise ValueError(f"surrogate: expected a callable, got {type(surrogate).__name__}")
    torch = _torch()
    x0 = x.astype(_work(x))
    low = np.clip(x0 - eps, lo, hi)
    high = np.clip(x0 + eps, lo, hi)
    adv = np.clip(x0, lo, hi)
    for _ in range(steps):
        adv += alpha * np.sign(_gradient(torch, surrogate, adv, target))
        np.clip(adv, low, high, out=adv)
    return adv.astype(x.dtype)


# --- masking ------------------------------------------------------------------------------------


def patch_mask(x: NDArray[FloatT], ratio: float, patch: int, rng: np.random.Generator,
               fill: float = 0.0) -> tuple[NDArray[FloatT], NDArray[np.bool_]]:
    """Fill ``round(ratio · cells)`` cells of the patch × patch grid with ``fill``.

    The grid has ceil(H / patch) × ceil(W / patch) cells (those on the right and bottom edges
    are cut to the image). ONE mask, drawn as ``rng.permutation(cells)[:k]``, is applied to
    every item of the batch and every channel, and returned as a boolean [gh, gw] array; a
    larger ratio with the same seed masks a superset of the cells. Seed: ratio 0.25.
    """
    _image(x)
    _share("ratio", ratio)
    _whole("patch", patch, 1)
    h, w = x.shape[-2:]
    gh, gw = -(-h // patch), -(-w // patch)
    cells = np.zeros(gh * gw, bool)
    cells[rng.permutation(gh * gw)[:_count(ratio, gh * gw)]] = True
    cells = cells.reshape(gh, gw)
    pixels = np.repeat(np.repeat(cells, patch, axis=0), patch, axis=1)[:h, :w]
    out = x.copy()
    out[..., pixels] = fill
    return out, cells


def occlude(x: NDArray[FloatT], area: float, rng: np.random.Generator,
            fill: float = 0.0) -> tuple[NDArray[FloatT], tuple[int, int, int, int]]:
    """Fill one block of about ``area`` of the frame (the image's aspect ratio, at a random
    place, the same for the whole batch) with ``fill``. Returns the image and the block as
    (top, left, height, width). Seed: 20 % of the area."""
    _image(x)
    _share("area", area)
    h, w = x.shape[-2:]
    bh, bw = round(h * math.sqrt(area)), round(w * math.sqrt(area))
    top, left = int(rng.integers(0, h - bh + 1)), int(rng.integers(0, w - bw + 1))
    out = x.copy()
    out[..., top:top + bh, left:left + bw] = fill
    return out, (top, left, bh, bw)


def token_mask(ids: NDArray[IntT], ratio: float, rng: np.random.Generator, pad_id: int = 0,
               mask_id: int | None = None) -> tuple[NDArray[IntT], NDArray[np.bool_]]:
    """Replace ``round(ratio · n)`` of the ``n`` non-pad tokens of each row by ``mask_id``
    (default ``pad_id``), in place of the token (positions do not move).

    Draws ``rng.random(ids.shape)`` once; in each row the non-pad positions with the smallest
    draws are masked (so a larger ratio masks a superset). Returns the ids and the mask.
    """
    _ids(ids)
    _share("ratio", ratio)
    keys = rng.random(ids.shape)
    real = ids != pad_id
    keys[~real] = np.inf
    order = np.argsort(keys, axis=-1, kind="stable")
    ranks = np.empty_like(order)
    np.put_along_axis(ranks, order, np.arange(ids.shape[-1]), axis=-1)
    k = np.floor(ratio * real.sum(axis=-1, keepdims=True) + 0.5)
    mask = ranks < k
    out = ids.copy()
    out[mask] = pad_id if mask_id is None else mask_id
    return out, mask


def shared_mask(seed: int, image: NDArray[FloatT], ids: NDArray[IntT], ratio: float, patch: int,
                pad_id: int = 0, mask_id: int | None = None,
                ) -> tuple[NDArray[FloatT], NDArray[IntT]]:
    """Mask the same share ``ratio`` of image patches and of tokens from ONE seed.

    Exactly: ``rng = numpy.random.default_rng(seed)``; the image first,
    ``patch_mask(image, ratio, patch, rng)`` (fill 0), then the text on the same stream,
    ``token_mask(ids, ratio, rng, pad_id, mask_id)``. The image's cells depend only on the seed
    and the grid; the tokens on the seed, the grid size, the ids' shape and where the padding is.
    """
    rng = np.random.default_rng(seed)
    image_out, _ = patch_mask(image, ratio, patch, rng)
    ids_out, _ = token_mask(ids, ratio, rng, pad_id, mask_id)
    return image_out, ids_out


def token_dropout(ids: NDArray[IntT], p: float, rng: np.random.Generator, pad_id: int = 0,
                  keep_first: int = 0) -> NDArray[IntT]:
    """Drop each non-pad token with probability ``p`` (seed 0.15); the rest keep their order
    and move left, and ``pad_id`` fills the end so the shape stays. The first ``keep_first``
    positions (e.g. a BOS) are never dropped; pads are never dropped, so a left-padded row keeps
    its leading pads. Draws ``rng.random(ids.shape)`` once."""
    _ids(ids)
    _share("p", p)
    _whole("keep_first", keep_first, 0)
    drop = rng.random(ids.shape) < p
    drop &= ids != pad_id
    drop[..., :keep_first] = False
    order = np.argsort(drop, axis=-1, kind="stable")  # kept positions first, in their order
    out = np.take_along_axis(ids, order, axis=-1)
    out[np.take_along_axis(drop, order, axis=-1)] = pad_id
    return out


# --- precision and image degradation -----------------------------------------------------------


def _bfloat16(a: NDArray[np.float32]) -> NDArray[np.float32]:
    """Round float32 to bfloat16 (nearest, ties to even) and widen back, as torch does."""
    with np.errstate(invalid="ignore", over="ignore"):  # NaN stays NaN, overflow is inf
        return a.astype(ml_dtypes.bfloat16).astype(np.float32)


def precision_collapse(x: NDArray[FloatT], mode: Literal["round", "fp16", "bf16"],
                       decimals: int = 3) -> NDArray[FloatT]:
    """What a lower-precision hop does to the values, returned in ``x``'s dtype.

    ``"round"``: round to ``decimals`` decimals; ``"fp16"``: through float16 (values beyond
    ±65504 become ±inf, as a real cast does); ``"bf16"``: through bfloat16, round to nearest
    even on the upper 16 bits of float32 (float64 input goes through float32 first).
    Any shape (not only images) is accepted.
    """
    if not isinstance(x, np.ndarray) or x.dtype not in (np.float16, np.float32, np.float64):
        got = x.dtype if isinstance(x, np.ndarray) else type(x).__name__
        raise ValueError(f"x: expected a float16/float32/float64 numpy array, got {got}")
    with np.errstate(over="ignore"):  # overflow to inf is the point of the collapse
        if mode == "round":
            if isinstance(decimals, bool) or not isinstance(decimals, int):
                raise ValueError(f"decimals: expected an integer, got {decimals!r}")
            # in float64: float32's x * 10**d is inexact and can round the wrong way
            return np.round(x.astype(np.float64), decimals).astype(x.dtype)
        if mode == "fp16":
            return x.astype(np.float16).astype(x.dtype)
        if mode == "bf16":
            return _bfloat16(x.astype(np.float32)).astype(x.dtype)
    raise ValueError(f"mode: expected 'round', 'fp16' or 'bf16', got {mode!r}")


def _gaussian_taps(radius: float) -> NDArray[np.float64]:
    half = max(1, math.ceil(3 * radius))
    taps = np.exp(-0.5 * (np.arange(-half, half + 1) / radius) ** 2)
    return np.asarray(taps / taps.sum(), np.float64)


def _filter_axis(a: NDArray[Any], taps: NDArray[np.float64], axis: int) -> NDArray[Any]:
    half = len(taps) // 2
    width = [(0, 0)] * a.ndim
    width[axis] = (half, half)
    padded = np.pad(a, width, mode="edge")  # edge, not reflect: works for any image size
    n = a.shape[axis]
    out = np.zeros_like(a)
    view: list[slice] = [slice(None)] * a.ndim
    for k, tap in enumerate(taps):
        view[axis] = slice(k, k + n)
        out += a.dtype.type(tap) * padded[tuple(view)]
    return out


def blur(x: NDArray[FloatT], radius: float) -> NDArray[FloatT]:
    """Separable Gaussian blur over H and W with standard deviation ``radius`` pixels (as PIL's
    ``GaussianBlur(radius)``), taps out to 3σ, edges extended; ``radius=0`` copies."""
    _image(x)
    _at_least("radius", radius, 0.0)
    if radius == 0:
        return x.copy()
    taps = _gaussian_taps(radius)
    y = _filter_axis(x.astype(_work(x)), taps, x.ndim - 2)
    return _filter_axis(y, taps, x.ndim - 1).astype(x.dtype)


def darken(x: NDArray[FloatT], factor: float, lo: float = 0.0,
           hi: float = 1.0) -> NDArray[FloatT]:
    """``x · factor`` clamped to [lo, hi] (seed low light: 0.3; a factor > 1 brightens)."""
    _image(x)
    _at_least("factor", factor, 0.0)
    _bounds(lo, hi)
    y = x.astype(_work(x)) * factor
    return np.clip(y, lo, hi, out=y).astype(x.dtype)


def quantise(x: NDArray[FloatT], levels: int, lo: float = 0.0,
             hi: float = 1.0) -> NDArray[FloatT]:
    """Snap each value (clamped to [lo, hi]) to the nearest of ``levels`` evenly spaced values
    from lo to hi (seed: 8 levels, a 3-bit image)."""
    _image(x)
    _whole("levels", levels, 2)
    _bounds(lo, hi)
    steps = levels - 1
    y: NDArray[Any] = (np.clip(x.astype(_work(x)), lo, hi) - lo) * (steps / (hi - lo))
    np.rint(y, out=y)
    y *= (hi - lo) / steps
    y += lo
    return y.astype(x.dtype)


# --- text ---------------------------------------------------------------------------------------

# Latin letters and a Cyrillic (or Greek) letter drawn the same in most fonts.
HOMOGLYPHS: dict[str, str] = {
    "a": "а", "c": "с", "e": "е", "i": "і", "j": "ј", "o": "о", "p": "р", "s": "ѕ", "x": "х",
    "y": "у", "h": "һ", "d": "ԁ", "v": "ν", "A": "А", "B": "В", "C": "С", "E": "Е", "H": "Н",
    "I": "І", "J": "Ј", "K": "К", "M": "М", "N": "Ν", "O": "О", "P": "Р", "S": "Ѕ", "T": "Т",
    "X": "Х", "Y": "Υ", "Z": "Ζ",
}
_WORD = re.compile(r"\S+")
_LAST_SPACE = re.compile(r"\s\S*\Z")


def word_dropout(text: str, p: float, rng: np.random.Generator) -> str:
    """Drop each whitespace-separated word with probability ``p``; the kept words are joined by
    single spaces (so runs of whitespace and newlines collapse). Draws one number per word."""
    _share("p", p)
    words = _WORD.findall(text)
    keep = rng.random(len(words)) >= p
    return " ".join(w for w, k in zip(words, keep, strict=True) if k)


def mixed_scripts(text: str, share: float, rng: np.random.Generator) -> str:
    """Replace ``round(share · n)`` of the ``n`` letters that have a look-alike in
    :data:`HOMOGLYPHS` (chosen by ``rng.permutation(n)``) with their Cyrillic/Greek twin."""
    _share("share", share)
    where = [i for i, ch in enumerate(text) if ch in HOMOGLYPHS]
    chars = list(text)
    for j in rng.permutation(len(where))[:_count(share, len(where))]:
        chars[where[j]] = HOMOGLYPHS[chars[where[j]]]
    return "".join(chars)


def cut_text(text: str, keep: float) -> str:
    """The first ``round(keep · len)`` characters, cut back to the last whitespace inside them
    when there is one (then trailing whitespace is removed); never longer than that count."""
    _share("keep", keep)
    n = _count(keep, len(text))
    if n >= len(text):
        return text
    head = text[:n]
    if not text[n].isspace() and not head[-1:].isspace():  # the cut falls inside a word
        last = _LAST_SPACE.search(head)
        if last and head[:last.start()].strip():
            head = head[:last.start()]
    return head.rstrip()
