"""Image decoding for scoring (proxy/wire/image_decode.py): reduced while decoding, never a
full-size array of a huge image, and a process-wide budget of pixels in flight that waits, then
refuses naming itself."""

from __future__ import annotations

import io
import threading
import time
import tracemalloc

import numpy as np
import pytest
from PIL import Image

from proxy.errors import ErrorKind, ProxyError
from proxy.wire.image_decode import DecodeBudget, decode_rgb
from tests.support.photos import clean_set


def encoded(img: Image.Image, fmt: str, **options: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **options)
    return buf.getvalue()


def photo(side: int) -> Image.Image:
    astronaut = next(c.image for c in clean_set() if c.name == "astronaut")
    return Image.fromarray(astronaut).resize((side, side), Image.Resampling.BICUBIC)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
def test_a_large_photo_is_reduced_to_between_max_side_and_twice_it(fmt: str) -> None:
    data = encoded(photo(2000), fmt)
    full = decode_rgb(data, "img")
    small = decode_rgb(data, "img", max_side=224)
    assert full.shape == (2000, 2000, 3)
    assert 224 <= small.shape[0] < 448 and small.shape[0] == small.shape[1]
    # the same picture: the reduced image matches the full one box-averaged to its size
    k = 2000 // small.shape[0]
    side = small.shape[0] * k
    boxed = full[:side, :side].reshape(small.shape[0], k, small.shape[0], k, 3).mean(axis=(1, 3))
    assert np.abs(boxed - small.astype(np.float64)).mean() < 6.0


def test_a_small_image_is_never_upscaled() -> None:
    assert decode_rgb(encoded(photo(100), "PNG"), "img", max_side=224).shape == (100, 100, 3)


def test_a_palette_png_is_reduced_in_rgb() -> None:
    data = encoded(photo(1200).convert("P"), "PNG")
    small = decode_rgb(data, "img", max_side=224)
    assert small.shape == (240, 240, 3) and small.dtype == np.uint8 and small.std() > 10


def test_a_6300_px_png_never_exists_as_a_full_size_array() -> None:
    # 170 KiB on the wire, 119 MB as a full RGB array: reduced, numpy holds ~0.4 MB
    data = encoded(Image.new("RGB", (6300, 6300), (90, 120, 200)), "PNG")
    tracemalloc.start()
    try:
        small = decode_rgb(data, "img", max_side=224)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert small.shape == (225, 225, 3) and (small == (90, 120, 200)).all()
    assert peak < 20 << 20  # numpy-side peak; PIL's own buffer is bounded by the budget


def test_an_image_over_the_pixel_limit_is_refused_from_its_header() -> None:
    data = encoded(Image.new("1", (8000, 5001)), "PNG")
    with pytest.raises(ProxyError) as err:
        decode_rgb(data, "messages[0].content[1].image_url", max_side=224)
    assert err.value.kind is ErrorKind.TOO_LARGE and "8000×5001" in err.value.message


def test_the_budget_waits_for_room_then_admits() -> None:
    budget = DecodeBudget(pixels=100, wait_s=5.0)
    entered = threading.Event()
    release = threading.Event()

    def hold() -> None:
        with budget.hold(80, "first"):
            entered.set()
            release.wait(5)

    t = threading.Thread(target=hold)
    t.start()
    assert entered.wait(5)
    threading.Timer(0.2, release.set).start()
    start = time.monotonic()
    with budget.hold(50, "second"):
        waited = time.monotonic() - start
        assert budget.in_flight == 50
    t.join(5)
    assert waited >= 0.1 and budget.in_flight == 0 and budget.peak == 80


def test_over_budget_past_the_wait_is_refused_naming_the_budget() -> None:
    budget = DecodeBudget(pixels=100, wait_s=0.05)
    with (budget.hold(80, "first"), pytest.raises(ProxyError) as err,
          budget.hold(50, "messages[0].content[2].image_url")):
        pass
    assert err.value.kind is ErrorKind.OVERLOADED and err.value.retry_after_s == 1.0
    assert err.value.message.startswith("messages[0].content[2].image_url: the image decode "
                                        "budget is spent (80 of 100 pixels in flight, this "
                                        "image needs 50)")
    assert budget.refused == 1 and budget.in_flight == 0


def test_an_image_larger_than_the_whole_budget_decodes_alone() -> None:
    budget = DecodeBudget(pixels=10, wait_s=0.05)
    out = decode_rgb(encoded(photo(64), "PNG"), "img", budget=budget)
    assert out.shape == (64, 64, 3) and budget.peak == 64 * 64


def _with_alpha(mode: str) -> Image.Image:
    """32 × 32, grey 20 everywhere; the right half opaque, the top left quarter's rows half
    transparent (RGBA and LA) and the rest of the left half fully transparent."""
    alpha = np.zeros((32, 32), np.uint8)
    alpha[:, 16:] = 255
    alpha[:8, :16] = 128
    grey = np.full((32, 32), 20, np.uint8)
    if mode == "RGBA":
        return Image.fromarray(np.dstack([grey, grey, grey, alpha]), "RGBA")
    if mode == "LA":
        return Image.fromarray(np.dstack([grey, alpha]), "LA")
    img = Image.fromarray((alpha == 255).astype(np.uint8), "P")  # a palette with a tRNS entry
    img.putpalette([20, 20, 20, 20, 20, 20])
    img.info["transparency"] = 0
    return img


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
@pytest.mark.parametrize("max_side", [None, 8])
def test_transparent_pixels_are_scored_over_white_as_vllm_shows_them(
        mode: str, max_side: int | None) -> None:
    # vLLM flattens transparency onto white before its model sees the image (its
    # convert_image_mode); the colour under a transparent pixel is not what the model gets
    got = decode_rgb(encoded(_with_alpha(mode), "PNG"), "img", max_side=max_side)
    if max_side is None:
        assert (got[:, 16:] == 20).all()  # opaque: as sent
        assert (got[8:, :16] == 255).all()  # transparent: white
        if mode != "P":  # half transparent: halfway to white
            assert np.abs(got[:8, :16].astype(int) - (20 * 128 + 255 * 127) // 255).max() <= 1
    else:  # reduced by 4 after the flattening: the same halves
        assert got.shape[:2] == (8, 8)
        assert (got[:, 4:] == 20).all() and (got[2:, :4] == 255).all()
