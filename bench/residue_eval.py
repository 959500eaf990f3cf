"""How well ``residue`` finds a faint copy of an earlier image of a request, on pairs of images.

    python -m bench.residue_eval [--out bench/out]

``residue`` reads two images, so its evaluation is made of pairs (``python -m bench.quality_eval``
runs this too, after its own tables). Clean pairs, each kind apart:

- unrelated photographs: each clean photograph and random crop of ``tests/support/photos.py``
  beside three others drawn at random (never a crop of the same source), the same on a
  held-out draw (other seeds), and the first pairs again with both images JPEG-compressed at
  quality 75 at 224 px (their block grids lie on each other);
- frames of one scene: two crops of one source photograph, the second moved by 0-32 source px
  and zoomed by 0-5 % (a camera that moved, a burst), at two framings;
- documents, screenshots and scientific images: every pair of two of them (whole frames and
  crops), the pairs of crops of one source apart, and every pair of rendered UIs (light and
  dark);

and the ladder: each photograph with an unrelated one laid over it at 3, 5, 10 and 15 % (the
later image of the pair; again with both JPEG-compressed at quality 75), and each document
with another document laid over it (the page before it left on the scanner). Prints per set
the share the 'screens' intent's rule flags (the residue score below 0.5) with its 95 % Wilson
interval, and per severity the AUC against the unrelated pairs and the share caught.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from bench.quality_eval import UINT8, auc, wilson
from filters.quality.residue import Trace, residues, trace
from filters.quality.rules import SCREEN_RULES
from filters.quality.signals import measure_image
from tests.support import photos

OPACITIES = (0.03, 0.05, 0.10, 0.15)
SHIFTS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32)  # source px
ZOOMS = (1.0, 0.99, 0.98, 0.95)
THRESHOLD = next(r.below for r in SCREEN_RULES if r.signal == "residue")


def _trace(x: photos.U8) -> Trace:
    found = trace(measure_image(x, UINT8)[1])
    assert found is not None
    return found


def pair_score(earlier: photos.U8, later: photos.U8) -> tuple[float, float]:
    """The later image's residue (score, value) against the earlier one, as the filter reads
    a request of the two."""
    found = residues([_trace(earlier), _trace(later)], ["image 0", "image 1"])[1]
    assert found is not None
    return found.score, found.value


def blend(x: photos.U8, other: photos.U8, opacity: float) -> photos.U8:
    """``other`` laid over ``x`` at ``opacity``."""
    mixed = (1 - opacity) * x.astype(np.float64) + opacity * other.astype(np.float64)
    return np.clip(mixed + 0.5, 0, 255).astype(np.uint8)


def _jpeg(x: photos.U8) -> photos.U8:
    """``x`` as a client sends a JPEG at the model's size: its 8-px block grid on the plane's."""
    return photos.jpeg(x, 75, np.random.default_rng(0))


def _source_of(name: str) -> str:
    return name.split("/")[0]


def _unrelated(cleans: tuple[photos.Clean, ...], seed: int
               ) -> Iterator[tuple[str, photos.U8, photos.U8]]:
    for i, c in enumerate(cleans):
        rng = np.random.default_rng([seed, i])
        for _ in range(3):
            k = cleans[int(rng.integers(len(cleans)))]
            if _source_of(k.name) != _source_of(c.name):
                yield f"{k.name} then {c.name}", k.image, c.image


def _same_scene() -> Iterator[tuple[str, photos.U8, photos.U8]]:
    for name in photos.PHOTOS:
        src = photos._source(name)
        h, w = src.shape[:2]
        for shift, zoom, frac in itertools.product(SHIFTS, ZOOMS, (0.8, 0.6)):
            if shift == 0 and zoom == 1.0:
                continue  # the same picture twice: a repeat, not a residue
            side = int(min(h, w) * frac)
            top, left = (h - side) // 2, (w - side) // 2
            first = photos.to_model_input(src, (left, top, left + side, top + side))
            moved = int(side * zoom)
            t2, l2 = top + shift // 2, left + shift
            second = photos.to_model_input(src, (l2, t2, l2 + moved, t2 + moved))
            yield f"{name} moved {shift} px, zoom {zoom:g}, framing {frac:g}", first, second


def pair_sets() -> dict[str, list[tuple[str, photos.U8, photos.U8]]]:
    """Every clean pair (earlier, later), by set."""
    cleans = tuple(c for c in photos.clean_set() if c.kind == "photo") + photos.random_crops()
    held = (tuple(c for c in photos.clean_set(seed=5) if c.kind == "photo")
            + photos.random_crops(seed=2))
    others = [c for c in photos.clean_set() if c.kind != "photo"]
    shots = photos.screenshots(8)
    return {
        "unrelated photographs": list(_unrelated(cleans, 21)),
        "unrelated photographs, held out": list(_unrelated(held, 31)),
        "unrelated photographs, both JPEG q75": [
            (f"{label} (JPEG q75)", _jpeg(x), _jpeg(y)) for label, x, y in _unrelated(cleans, 21)],
        "frames of one scene": list(_same_scene()),
        "documents, screenshots, scientific": [
            (f"{a.name} then {b.name}", a.image, b.image)
            for a, b in itertools.combinations(others, 2)
            if _source_of(a.name) != _source_of(b.name)],
        "two crops of one source (not photos)": [
            (f"{a.name} then {b.name}", a.image, b.image)
            for a, b in itertools.combinations(others, 2)
            if _source_of(a.name) == _source_of(b.name)],
        "rendered UIs": [(f"{a} then {b}", x, y)
                         for (a, x), (b, y) in itertools.combinations(shots, 2)],
    }


def ladders() -> dict[str, dict[float, list[tuple[str, photos.U8, photos.U8]]]]:
    """(earlier, later with the earlier laid over it) per opacity: photographs, documents."""
    cleans = tuple(c for c in photos.clean_set() if c.kind == "photo") + photos.random_crops()
    docs = [c for c in photos.clean_set() if c.kind == "document"]
    out: dict[str, dict[float, list[tuple[str, photos.U8, photos.U8]]]] = {
        "photographs": {}, "photographs, both JPEG q75": {}, "documents": {}}
    for a in OPACITIES:
        rows = []
        for i, c in enumerate(cleans):
            rng = np.random.default_rng([22, i])
            k = cleans[int(rng.integers(len(cleans)))]
            if _source_of(k.name) != _source_of(c.name):
                rows.append((f"{k.name} over {c.name}", k.image, blend(c.image, k.image, a)))
        out["photographs"][a] = rows
        out["photographs, both JPEG q75"][a] = [(f"{label} (JPEG q75)", _jpeg(x), _jpeg(y))
                                                for label, x, y in rows]
        out["documents"][a] = [(f"{k.name} over {c.name}", k.image, blend(c.image, k.image, a))
                               for c, k in itertools.permutations(docs, 2)
                               if _source_of(k.name) != _source_of(c.name)]
    return out


def evaluate() -> dict[str, Any]:
    clean: dict[str, Any] = {}
    for name, pairs in pair_sets().items():
        scored = [(label, *pair_score(x, y)) for label, x, y in pairs]
        flagged = [label for label, s, _ in scored if s < THRESHOLD]
        clean[name] = {"n": len(scored), "flagged": len(flagged),
                       "rate": len(flagged) / len(scored),
                       "interval": wilson(len(flagged), len(scored)), "which": flagged,
                       "highest": max(v for _, _, v in scored)}
    null = [pair_score(x, y)[0] for _, x, y in pair_sets()["unrelated photographs"]]
    ladder: dict[str, Any] = {}
    for kind, by_opacity in ladders().items():
        ladder[kind] = {}
        for a, pairs in by_opacity.items():
            scores = [pair_score(x, y)[0] for _, x, y in pairs]
            caught = sum(s < THRESHOLD for s in scores)
            ladder[kind][f"{a:g}"] = {"n": len(scores), "auc": auc(null, scores),
                                      "caught": caught / len(scores),
                                      "interval": wilson(caught, len(scores))}
    return {"threshold": THRESHOLD, "clean": clean, "ladder": ladder}


def table(result: dict[str, Any]) -> str:
    rows = [f"residue (a faint copy of an earlier image of the request), rule: score < "
            f"{result['threshold']:g}", "clean pairs flagged:"]
    for name, r in result["clean"].items():
        lo, hi = r["interval"]
        rows.append(f"  {name:36s} {r['flagged']:4d} / {r['n']:4d} = {r['rate']:6.1%} "
                    f"[{lo:5.1%}, {hi:5.1%}]  highest value {r['highest']:.3f}  "
                    + "; ".join(r["which"][:2]) + (" ..." if len(r["which"]) > 2 else ""))
    rows.append("an earlier image laid over the later one (AUC against the unrelated "
                "photographs; caught at the rule):")
    for kind, by_opacity in result["ladder"].items():
        rows.append(f"  {kind}: " + ", ".join(
            f"{a}: AUC {r['auc']:.3f}, {r['caught']:.0%} of {r['n']} "
            f"[{r['interval'][0]:.0%}, {r['interval'][1]:.0%}]" for a, r in by_opacity.items()))
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.residue_eval",
                                     description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out")
    args = parser.parse_args()
    result = evaluate()
    print(table(result))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "residue_eval.json").write_text(json.dumps(result, indent=1))
    print(f"\nwrote {args.out / 'residue_eval.json'}")


if __name__ == "__main__":
    main()
