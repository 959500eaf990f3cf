"""The quality signals on real photographs (tests/support/photos.py: scikit-image's photos,
resized as a client would, with seeded degradations at the source documents' severities).

What must hold: each degradation scores worse than its clean source on the signal meant for it;
the targets (ROC AUC >= 0.95 for noise, blur, low light and resolution collapse; at most 1 % of
clean photos and random crops of them flagged by the default rules); and the behaviour
docs/quality.md states for documents, dark photos and textures."""

from __future__ import annotations

import itertools
from functools import cache
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from filters.quality.filter import QualityConfig
from filters.quality.scenes import OPTIONAL_SIGNALS
from filters.quality.signals import IMAGE_SIGNALS, ImageSpec, Signal, image_signals
from tests.support import photos

UINT8 = ImageSpec("HWC", (0.0,), (255.0,))
FLOAT = ImageSpec("HWC", (0.0,), (1.0,))
TARGETS = ("gaussian", "poisson", "low_light", "defocus", "motion", "collapse")


def score(x: NDArray[Any]) -> dict[str, Signal]:
    return image_signals(x, UINT8 if x.dtype == np.uint8 else FLOAT, OPTIONAL_SIGNALS)


@cache
def thresholds() -> dict[str, float]:
    return {r.signal: r.below for r in QualityConfig().rules if r.signal in IMAGE_SIGNALS}


def flagged(s: dict[str, Signal]) -> list[str]:
    return [k for k, below in thresholds().items() if s[k].score < below]


@cache
def pairs(name: str, severity: float) -> list[tuple[str, dict[str, Signal], dict[str, Signal]]]:
    d = photos.BY_NAME[name]
    return [(c.name, score(c.image), score(x)) for c, x in photos.degraded(d, severity)]


def auc(clean: list[float], bad: list[float]) -> float:
    c = np.asarray(clean)[:, None]
    b = np.asarray(bad)[None, :]
    return float(((c > b).sum() + 0.5 * (c == b).sum()) / (c.size * b.size))


@pytest.mark.parametrize("d", [d for d in photos.DEGRADATIONS if d.signal],
                         ids=lambda d: d.name)
def test_each_degradation_scores_worse_than_its_source_on_its_signal(
        d: photos.Degradation) -> None:
    found = pairs(d.name, d.source)
    worse = [n for n, clean, bad in found if bad[d.signal].score < clean[d.signal].score]
    higher = [n for n, clean, bad in found if bad[d.signal].score > clean[d.signal].score + 1e-6
              # brick's own repetition, and a rocket crop's at 4 px, read as a faint ghost
              # that a shifted copy blurs (the documented confusion: docs/quality.md, ghosting)
              and not (d.name == "ghost" and (n.startswith("brick") or n == "rocket/crop1"))]
    assert not higher, f"{d.name}: scores higher than the clean source on {d.signal}: {higher}"
    # strictly worse: nearly all for the targets; a gamma curve that keeps the highlights is
    # often forgiven as a dark scene (docs/quality.md), so only some for the others
    assert len(worse) >= (0.9 if d.name in TARGETS else 0.1) * len(found), d.name


@pytest.mark.parametrize("name", (*TARGETS, "jpeg"))
def test_targets_auc_at_the_source_severity(name: str) -> None:
    d = photos.BY_NAME[name]
    found = pairs(name, d.source)
    clean = [c[d.signal].score for _, c, _ in found]
    bad = [b[d.signal].score for _, _, b in found]
    assert auc(clean, bad) >= 0.95
    assert np.mean([d.signal in flagged(b) for _, _, b in found]) >= 0.7


def test_severity_ladders_detect_more_as_they_get_worse() -> None:
    for name in ("gaussian", "low_light", "defocus", "collapse"):
        d = photos.BY_NAME[name]
        rates = [np.mean([bool(flagged(b)) for _, _, b in pairs(name, s)]) for s in d.ladder]
        # one step may lose an image or two (at 8.7x a texture crop rings back into 'sharp')
        assert all(b >= a - 0.02 for a, b in itertools.pairwise(rates)), (name, rates)
        assert rates[-1] >= 0.95 and rates[0] < rates[-1], (name, rates)


def test_at_most_1_percent_of_clean_photos_and_random_crops_are_flagged_by_default() -> None:
    clean = [c for c in (*photos.clean_set(), *photos.random_crops()) if c.kind == "photo"]
    hits = [c.name for c in clean if flagged(score(c.image))]
    assert len(clean) >= 240 and len(hits) <= 0.01 * len(clean), hits
    whole = [c for c in photos.whole_frames() if c.kind == "photo"]
    assert not [c.name for c in whole if flagged(score(c.image))]


def test_documents_and_white_pages_are_not_read_as_over_exposed() -> None:
    docs = [c for c in photos.clean_set() if c.kind == "document"]
    assert {c.name for c in docs} >= {"page", "text", "page/levelled", "text/levelled"}
    for c in docs:
        s = score(c.image)
        assert s["exposure"].score >= 0.5, (c.name, s["exposure"])
        assert not flagged(s), (c.name, flagged(s))
    # while the same white, with the ink gone (a blown photo of nothing: its unblown band
    # carries sensor noise, so it is not a flat-colour drawing), is over-exposed
    blown = np.full((224, 224, 3), 255, np.uint8)
    band = np.random.default_rng(0).normal(200, 3, (40, 224, 3))
    blown[:40] = np.clip(band, 0, 255).round().astype(np.uint8)
    assert score(blown)["exposure"].score < 0.5


def test_a_dark_but_sharp_photo_is_not_read_as_blurred() -> None:
    found = pairs("low_light", 0.1)
    assert all(b["sharpness"].score >= 0.5 for _, _, b in found)
    assert all("exposure" in flagged(b) for _, _, b in found)


def test_texture_is_not_read_as_noise() -> None:
    textures = [c for c in photos.clean_set() if c.name.split("/")[0] in ("grass", "gravel",
                                                                          "brick")]
    assert len(textures) == 27
    assert all(score(c.image)["noise"].score >= 0.5 for c in textures)


def test_a_dark_scene_with_highlights_is_not_low_light() -> None:
    # the Hubble deep field: mean luminance 0.08, but its stars are bright
    hubble = [c for c in photos.clean_set() if c.name.startswith("hubble_deep_field")]
    assert all(score(c.image)["exposure"].score >= 0.5 for c in hubble)


def test_nan_and_wrong_range_are_always_caught() -> None:
    for name in ("nan", "wrong_range"):
        d = photos.BY_NAME[name]
        for sev in d.ladder:
            assert all(bool(flagged(b)) for _, _, b in pairs(name, sev)), (name, sev)


def test_the_lfw_faces_upscaled_9x_read_blurred() -> None:
    faces = [score(f) for f in photos.faces(20)]
    assert all(s["sharpness"].score < 0.5 for s in faces)


def test_blockiness_sees_the_8px_grid_only() -> None:
    # the documented confusion: an 8-px checkerboard on the grid reads as JPEG blocking; the
    # same shifted by 4 px, or at another period, does not
    yy, xx = np.mgrid[0:224, 0:224]
    for shift, period, blocky in ((0, 8, True), (4, 8, False), (0, 6, False), (0, 2, False)):
        checks = (((yy + shift) // period + (xx + shift) // period) % 2) * 120 + 60
        img = np.repeat(checks[..., None], 3, axis=2).astype(np.uint8)
        assert (score(img)["blockiness"].score < 0.5) is blocky, (shift, period)
