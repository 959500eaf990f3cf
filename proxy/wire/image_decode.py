"""Decoding client images without letting a small file cost a gigabyte.

A 170 KiB PNG can declare 6300 × 6300 pixels: decoded to RGB it is 119 MB as a numpy array and
159 MB inside PIL (4 bytes a pixel), and four of them at once added 1.8 GB to the proxy. Two
defences, both here:

- ``decode_rgb(..., max_side=...)`` decodes only as much as the caller needs: a JPEG is decoded
  at 1/2, 1/4 or 1/8 scale by libjpeg itself (``draft``), anything else is reduced by an integer
  factor right after decoding, before any RGB copy or numpy array exists. Scoring reads ~224 px
  (the quality signals work at that scale), so a 6300 px image never exists as a full-size
  array.
- ``DECODE_BUDGET``: the pixels being decoded at once, process-wide. A decode waits (briefly,
  in its worker thread, never on the event loop) for room and is refused with 429 naming the
  budget when there is none: memory for decoding stays bounded whatever the clients send.

Images above ``MAX_IMAGE_PIXELS`` are refused from their header, before any pixel is decoded.
"""

from __future__ import annotations

import io
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
from numpy.typing import NDArray

from proxy.errors import ErrorKind, ProxyError

MAX_IMAGE_PIXELS = 40_000_000
"""Images larger than this (e.g. 8000 × 5000) are refused before decoding."""
DEFAULT_BUDGET_PIXELS = 48_000_000
"""Pixels being decoded at once, process-wide: one image at the limit, or many small ones
(~200 MB of decoder memory at 4 bytes a pixel)."""
DEFAULT_WAIT_S = 2.0


class DecodeBudget:
    """Pixels in flight across every decoding thread. An image larger than the whole budget
    still decodes when nothing else is (else it could never be decoded)."""

    def __init__(self, pixels: int = DEFAULT_BUDGET_PIXELS, wait_s: float = DEFAULT_WAIT_S) -> None:
        self.pixels = pixels
        self.wait_s = wait_s
        self.in_flight = 0
        self.refused = 0
        self.peak = 0
        self._cond = threading.Condition()

    def configure(self, pixels: int, wait_s: float) -> None:
        with self._cond:
            self.pixels, self.wait_s = pixels, wait_s
            self._cond.notify_all()

    @contextmanager
    def hold(self, pixels: int, what: str) -> Iterator[None]:
        deadline = time.monotonic() + self.wait_s
        with self._cond:
            while self.in_flight and self.in_flight + pixels > self.pixels:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.refused += 1
                    raise ProxyError(
                        ErrorKind.OVERLOADED,
                        f"{what}: the image decode budget is spent ({self.in_flight} of "
                        f"{self.pixels} pixels in flight, this image needs {pixels}); retry "
                        "shortly", retry_after_s=1.0, param=what)
                self._cond.wait(left)
            self.in_flight += pixels
            self.peak = max(self.peak, self.in_flight)
        try:
            yield
        finally:
            with self._cond:
                self.in_flight -= pixels
                self._cond.notify_all()


DECODE_BUDGET = DecodeBudget()


def _return_big_buffers_to_the_system() -> None:
    """Make glibc serve every allocation of 8 MiB or more with its own mmap, so the memory of a
    decoded image goes back to the system when the image is freed; smaller ones, such as most
    request tensors, keep reusing heap memory (a fresh mapping costs page faults). By default
    glibc raises that threshold after each large free (up to 32 MiB), and PIL's 16 MiB image
    blocks then come from per-thread heaps that keep them: four decodes in four worker threads
    left ~350 MB resident after they were done.

    Setting the threshold also fixes glibc's trim threshold at its 128 KiB default (it is
    dynamic, twice the mmap threshold, only while that one is): every free that left more than
    that at the top of the heap gave it back, and the next request's buffers and numpy
    temporaries faulted it in again, page by page (a 1.2 MB float64 copy: 50 -> 390 µs; 600 KB
    gRPC requests at 16 in flight: ~200 page faults each). Trimming is kept, above twice the
    mmap threshold, as glibc's own dynamic rule would have it (4 MiB was too little for 16 such
    requests in flight); the price: a heap may keep up to 16 MiB free (after four 40 Mpx
    decodes, RSS +32 MiB instead of +3)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_FROM)
        libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_FROM)
    except (OSError, AttributeError):  # not glibc: its allocator has its own policy
        return


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_FROM = 8 << 20  # PIL's blocks are 16 MiB; request tensors below this keep reusing the heap
_TRIM_FROM = 2 * _MMAP_FROM  # free memory a heap keeps at its top (glibc's dynamic rule)
_return_big_buffers_to_the_system()


def decode_rgb(data: bytes, what: str, max_side: int | None = None,
               budget: DecodeBudget = DECODE_BUDGET) -> NDArray[np.uint8]:
    """H × W × 3 uint8 pixels of an image file. With ``max_side``, the short side is reduced
    to between ``max_side`` and twice it (never up-scaled); without, full size."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as img:
                w, h = img.size
                if w * h > MAX_IMAGE_PIXELS:
                    raise ProxyError(ErrorKind.TOO_LARGE, f"{what}: the image is {w}×{h} = "
                                     f"{w * h} pixels; mmguard decodes at most "
                                     f"{MAX_IMAGE_PIXELS}", param=what)
                if max_side is not None and img.format == "JPEG":
                    # libjpeg decodes at 1/2, 1/4 or 1/8 scale, keeping the size >= asked
                    scale = max(1, min(w, h) // max_side)
                    img.draft("RGB", (max(1, w // scale), max(1, h // scale)))
                dw, dh = img.size
                with budget.hold(dw * dh, what):
                    return _pixels(img, max_side)
    except ProxyError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ProxyError(ErrorKind.TOO_LARGE, f"{what}: {exc}", param=what) from None
    except (OSError, ValueError, SyntaxError, EOFError, MemoryError) as exc:
        # PIL reports broken files as any of these (UnidentifiedImageError is an OSError)
        raise ProxyError(ErrorKind.INVALID_ARGUMENT, f"{what}: not a decodable image: {exc}",
                         param=what) from None


def _pixels(img: object, max_side: int | None) -> NDArray[np.uint8]:
    from PIL import Image

    assert isinstance(img, Image.Image)
    img.load()
    if (img.mode in ("LA", "PA") or "transparency" in img.info) and img.mode != "RGBA":
        rgba = img.convert("RGBA")  # a palette's or a colour key's transparency as alpha
        img.close()
        img = rgba
    factor = 1 if max_side is None else min(img.size) // max_side
    if factor >= 2:
        # reduce() is a box filter of integer factor; palette and odd modes go to RGB first
        small = img.reduce(factor) if img.mode in ("L", "RGB", "RGBA") else (
            img.convert("RGB").reduce(factor))
        img.close()  # the full-size pixels go now, not when the caller's frame ends
        img = small
    if img.mode == "RGBA":
        # What vLLM hands the model: transparent pixels over white (its convert_image_mode),
        # not the colours under them, which a plain convert("RGB") keeps. Flattened once
        # reduced: a huge image's alpha costs no full-size copy
        flat = Image.new("RGB", img.size, (255, 255, 255))
        flat.paste(img, mask=img.getchannel("A"))
        img.close()
        img = flat
    return np.asarray(img if img.mode == "RGB" else img.convert("RGB"), dtype=np.uint8)
