"""How well the quality signals catch real degradations of real photographs, in numbers.

    python -m bench.quality_eval [--out bench/out] [--all-severities] [--only keystone,...]

Builds the evaluation set of ``tests/support/photos.py`` (the photographs scikit-image,
matplotlib and scikit-learn ship in their wheels, resized to 224 × 224 as a client would; documents,
illustrations, scientific images and rendered screenshots as clean inputs of their own kinds),
makes every degradation at every severity of its ladder, and scores everything with the
shipped signals (``ghosting`` and ``moire`` included). Prints, per degradation:

- the ROC AUC of each signal (clean photos against their degraded copies; 1.0 = every degraded
  copy scores below every clean photo);
- at the shipped default rules (``QualityConfig().rules``), the share of degraded copies that
  a rule catches, per severity;
- for the ladders of ``KIND_LADDERS`` (keystone), the same on the documents and on the
  screenshots (their clean inputs of every framing against keystoned copies of them);

then, per framing (the evaluation framing, random crops, whole frames) and per kind of clean
input, the share that a default rule flags, with its 95 % Wilson interval; and the operating
points: per signal, the highest threshold that flags at most 1 % (and none) of the clean
photographs of the evaluation framing and the random crops together, where the defaults come
from. Writes ``roc.png`` (one panel per degradation: the ROC of the signal meant for it, one
curve per severity) and ``quality_eval.json`` to ``--out``. Without ``--only``, the pairs of
``bench/residue_eval.py`` follow (``residue`` compares a request's images with each other).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray
from PIL import Image, ImageDraw

from filters.quality.filter import QualityConfig
from filters.quality.scenes import OPTIONAL_SIGNALS
from filters.quality.signals import IMAGE_SIGNALS, REQUEST_SIGNALS, ImageSpec, Signal, image_signals
from tests.support import photos

UINT8 = ImageSpec("HWC", (0.0,), (255.0,))
FLOAT = ImageSpec("HWC", (0.0,), (1.0,))
Scores = dict[str, Signal]


def score(x: NDArray[Any]) -> Scores:
    return image_signals(x, UINT8 if x.dtype == np.uint8 else FLOAT, OPTIONAL_SIGNALS)


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson score interval of a rate (sound at 0 hits, unlike the normal one)."""
    if n == 0:
        return 0.0, 1.0
    p = hits / n
    mid = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, mid - half), min(1.0, mid + half)


INTENTS = ("photos", "recall", "screens")
RULED = ("range", "sharpness", "exposure", "noise", "blockiness", "perspective", "tone", "shake",
         "ghosting", "moire", "washout")
GRID = tuple(round(0.05 * i, 2) for i in range(1, 20))


def operating_points(photo_scores: list[Scores], budget: float = 0.01) -> dict[str, float]:
    """Per signal, the highest 'below' (on a 0.05 grid) that flags at most ``budget`` of the
    clean photographs (the evaluation framing and the random crops together)."""
    out = {}
    for k in RULED:
        ok = [b for b in GRID if np.mean([s[k].score < b for s in photo_scores]) <= budget]
        out[k] = max(ok) if ok else 0.0
    return out


def auc(clean: Sequence[float], degraded: Sequence[float]) -> float:
    """P(a clean image scores above a degraded one), ties counted half (Mann-Whitney)."""
    c = np.asarray(clean, np.float64)[:, None]
    d = np.asarray(degraded, np.float64)[None, :]
    return float(((c > d).sum() + 0.5 * (c == d).sum()) / (c.size * d.size))


def roc(clean: Sequence[float], degraded: Sequence[float]) -> list[tuple[float, float]]:
    """(false-positive rate, detection rate) for every threshold, degraded = below it."""
    cuts = sorted({*clean, *degraded, 1.01})
    c, d = np.asarray(clean), np.asarray(degraded)
    return [(0.0, 0.0)] + [(float((c < t).mean()), float((d < t).mean())) for t in cuts]


def default_thresholds(intent: str = "photos") -> dict[str, float]:
    """Image signal → the highest 'below' of ``intent``'s rules on it (the shipped default
    rules: 'photos')."""
    out: dict[str, float] = {}
    for rule in QualityConfig.model_validate({"intent": intent}).rules:
        if rule.signal in IMAGE_SIGNALS and rule.signal not in REQUEST_SIGNALS:
            out[rule.signal] = max(out.get(rule.signal, 0.0), rule.below)
    return out


def opt_in_rules() -> dict[str, float]:
    """The opt-in signals of one image (no default rule) at the rule a deployment would write,
    below 0.5. ``residue`` compares a request's images with each other, not one image: its
    pairs are bench/residue_eval.py's."""
    return {k: 0.5 for k in sorted(OPTIONAL_SIGNALS) if k not in REQUEST_SIGNALS}


def flagged(s: Scores, thresholds: dict[str, float]) -> list[str]:
    return [k for k, below in thresholds.items() if s[k].score < below]


def false_positives(rows: list[tuple[photos.Clean, Scores]],
                    thresholds: dict[str, float]) -> dict[str, Any]:
    hits = [(c.name, flagged(s, thresholds)) for c, s in rows]
    n, k = len(rows), sum(1 for _, f in hits if f)
    return {"n": n, "flagged": k, "rate": k / max(n, 1), "interval": wilson(k, n),
            "per_signal": {s: sum(1 for _, f in hits if s in f) for s in thresholds},
            "which": [f"{name}: {', '.join(f)}" for name, f in hits if f]}


def framings() -> dict[str, list[photos.Clean]]:
    return {"eval framing": list(photos.clean_set()), "random crops": list(photos.random_crops()),
            "whole frames": list(photos.whole_frames()),
            "high-key (synthetic)": list(photos.high_key())}


def _false_positives_by_set(scored: dict[str, list[Any]],
                            thresholds: dict[str, float]) -> dict[str, Any]:
    """``false_positives`` of every framing and kind of clean input that has any, under the
    rules ``thresholds`` (signal -> below)."""
    out: dict[str, Any] = {}
    for framing, rows in scored.items():
        for kind in ("photo", "scientific", "document", "screenshot", "illustration",
                     "high-key"):
            mine = [(c, s) for c, s in rows if c.kind == kind]
            if mine:
                out[f"{framing} / {kind}"] = false_positives(mine, thresholds)
    return out


# Ladders measured on other kinds of clean input too, each against the clean inputs of its kind
# (every framing): a screen or a page keystoned is what users photograph, a photograph has
# nothing straight to see.
KIND_LADDERS = {"keystone": ("document", "screenshot")}
KIND_SEEDS = 4  # keystoned copies per clean input (the near side is drawn per copy)


def _kind_ladder(d: photos.Degradation, scored: dict[str, list[Any]], kind: str,
                 thresholds: dict[str, float], opt_in: dict[str, float]) -> dict[str, Any]:
    """``d``'s ladder on the clean inputs of ``kind`` of every framing: per severity, the AUC
    of every signal (those clean inputs against their degraded copies, ``KIND_SEEDS`` each)
    and the share caught by the default rules and by ``d.signal``'s rule alone."""
    rules = {**opt_in, **thresholds}
    rows = [(c, s) for f in scored.values() for c, s in f if c.kind == kind]
    clean = [s for _, s in rows]
    out: dict[str, Any] = {"n_clean": len(rows), "severities": {}}
    for sev in d.ladder:
        got = [score(np.asarray(d.apply(c.image, sev, np.random.default_rng(
            [seed, i, int(abs(sev) * 1000)]))))
            for i, (c, _) in enumerate(rows) for seed in range(KIND_SEEDS)]
        out["severities"][f"{sev:g}"] = {
            "n": len(got),
            "auc": {k: auc([s[k].score for s in clean], [s[k].score for s in got])
                    for k in IMAGE_SIGNALS},
            "detected": float(np.mean([bool(flagged(s, thresholds)) for s in got])),
            "detected_by_signal": float(np.mean([s[d.signal].score < rules[d.signal]
                                                 for s in got]))
            if d.signal in rules else None}
    return out


def evaluate(only: Sequence[str] = ()) -> dict[str, Any]:
    thresholds = default_thresholds()
    scored = {f: [(c, score(c.image)) for c in cs] for f, cs in framings().items()}
    photo = [s for c, s in scored["eval framing"] if c.kind == "photo"]
    fp = _false_positives_by_set(scored, thresholds)
    # The opt-in signals (no default rule) at the rule a deployment would write, below 0.5:
    # what that rule alone would flag, per framing and kind.
    opt_in = opt_in_rules()
    fp_opt = _false_positives_by_set(scored, opt_in)
    crops = [s for c, s in scored["random crops"]]
    faces = [score(f) for f in photos.faces()]
    shaken = [(n, score(x)) for n, x in photos.camera_shake()]
    intents = {name: default_thresholds(name) for name in INTENTS}
    out: dict[str, Any] = {"thresholds": thresholds, "false_positives": fp, "degradations": {},
                           "intents": {name: {"thresholds": t, "false_positives":
                                              _false_positives_by_set(scored, t)}
                                       for name, t in intents.items()},
                           "opt_in_thresholds": opt_in, "opt_in_false_positives": fp_opt,
                           "operating_points": operating_points(photo + crops),
                           "operating_points_none": operating_points(photo + crops, 0.0),
                           "faces_lfw": {"n": len(faces), "detected": float(np.mean(
                               [bool(flagged(s, thresholds)) for s in faces])),
                               "sharpness_below": float(np.mean(
                                   [s["sharpness"].score < thresholds.get("sharpness", 0)
                                    for s in faces]))},
                           "camera_shake_clock": {
                               "n": len(shaken),
                               "flagged": [n for n, s in shaken if flagged(s, thresholds)],
                               "sharpness": {n: round(s["sharpness"].value, 3)
                                             for n, s in shaken},
                               "shake": {n: round(s["shake"].value, 3) for n, s in shaken}}}
    for d in photos.DEGRADATIONS:
        if only and d.name not in only:
            continue
        entry: dict[str, Any] = {"signal": d.signal, "source": d.source, "unit": d.unit,
                                 "severities": {}}
        for sev in d.ladder:
            got = [score(x) for _, x in photos.degraded(d, sev)]
            entry["severities"][f"{sev:g}"] = {
                "auc": {k: auc([s[k].score for s in photo], [s[k].score for s in got])
                        for k in IMAGE_SIGNALS},
                "detected": float(np.mean([bool(flagged(s, thresholds)) for s in got])),
                "detected_by_intent": {name: float(np.mean([bool(flagged(s, t)) for s in got]))
                                       for name, t in intents.items()},
                "detected_by_signal": float(np.mean(
                    [s[d.signal].score < {**opt_in, **thresholds}[d.signal] for s in got]))
                if d.signal in {**opt_in, **thresholds} else None,
                "roc": roc([s[d.signal or "sharpness"].score for s in photo],
                           [s[d.signal or "sharpness"].score for s in got]),
            }
        out["degradations"][d.name] = entry
        entry["by_kind"] = {k: _kind_ladder(d, scored, k, thresholds, opt_in)
                            for k in KIND_LADDERS.get(d.name, ())}
    return out


def table(result: dict[str, Any], all_severities: bool) -> str:
    short = {"finite": "fin", "range": "rng", "constant": "cst", "sharpness": "shp",
             "exposure": "exp", "noise": "noi", "blockiness": "blk", "perspective": "psp",
             "tone": "ton", "shake": "shk", "ghosting": "gho", "moire": "moi",
             "washout": "wsh"}
    head = (f"{'degradation':13s} {'severity':>10s} " + " ".join(f"{short[k]:>5s}"
            for k in IMAGE_SIGNALS) + f" {'meant':>9s} {'detected':>8s}")
    rules = {**result["opt_in_thresholds"], **result["thresholds"]}
    lines = ["ROC AUC per signal (clean photos vs degraded copies); detected = share caught by a "
             "default rule (by its meant signal's default or opt-in rule alone)", head,
             "-" * len(head)]

    def row(label: str, sev: str, mark: str, d: dict[str, Any], r: dict[str, Any]) -> str:
        return (f"{label:13s} {sev + ' ' + d['unit'][:4]:>10s}{mark}"
                + " ".join(f"{r['auc'][k]:5.3f}" for k in IMAGE_SIGNALS)
                + f" {d['signal'] or '-':>9s} {r['detected']:8.0%}"
                + (f" (by {d['signal']} < {rules[d['signal']]:g}:"
                   f" {r['detected_by_signal']:.0%})" if d["signal"] in rules else ""))

    for name, d in result["degradations"].items():
        for sev, r in d["severities"].items():
            is_source = float(sev) == d["source"]
            if not (all_severities or is_source or len(d["severities"]) <= 4):
                continue
            mark = "*" if is_source else " "
            lines.append(row(name, sev, mark, d, r))
            for kind, k in d.get("by_kind", {}).items():
                r_kind = k["severities"][sev]
                lines.append(row(f"  {kind[:3]} {k['n_clean']}/{r_kind['n']}", sev, mark, d,
                                 r_kind))
    lines.append("* the severity the source documents name; indented (doc, scr): the same "
                 "ladder on another kind's clean inputs of every framing (clean n / degraded n)")
    lines.append("")
    lines.append("false positives at the default rules "
                 + ", ".join(f"{k} < {v:g}" for k, v in result["thresholds"].items()))
    lines += _false_positive_rows(result["false_positives"])
    lines.append("false positives of the opt-in rules alone, "
                 + ", ".join(f"{k} < {v:g}" for k, v in result["opt_in_thresholds"].items()))
    lines += _false_positive_rows(result["opt_in_false_positives"])
    lines += _intent_rows(result)
    for key, what in (("operating_points", "<= 1 %"), ("operating_points_none", "none")):
        lines.append(f"operating points (highest 'below' flagging {what} of the clean photos, "
                     "eval framing + random crops): " + ", ".join(
                         f"{k} {v:g}" for k, v in result[key].items()))
    f = result["faces_lfw"]
    lines.append(f"lfw faces (25 px, up-scaled 9x by the client): {f['detected']:.0%} of {f['n']} "
                 f"flagged, {f['sharpness_below']:.0%} by sharpness")
    c = result["camera_shake_clock"]
    lines.append(f"real camera shake (skimage's clock, whole + 4 crops): {len(c['flagged'])} of "
                 f"{c['n']} flagged; sharpness ratio " + ", ".join(
                     f"{n} {v:g}" for n, v in c["sharpness"].items())
                 + "; shake's edge ratio " + ", ".join(
                     f"{n} {v:g}" for n, v in c["shake"].items()))
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """ROC panels, drawn with PIL (no plotting library needed)."""
    names = list(result["degradations"])
    cols, size, pad = 4, 240, 36
    rows = (len(names) + cols - 1) // cols
    img = Image.new("RGB", (cols * (size + pad) + pad, rows * (size + pad + 18) + pad), "white")
    draw = ImageDraw.Draw(img)
    palette = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189)]
    for i, name in enumerate(names):
        d = result["degradations"][name]
        x0 = pad + (i % cols) * (size + pad)
        y0 = pad + (i // cols) * (size + pad + 18)
        draw.rectangle((x0, y0, x0 + size, y0 + size), outline=(0, 0, 0))
        draw.line((x0, y0 + size, x0 + size, y0), fill=(200, 200, 200))
        draw.text((x0, y0 - 14), f"{name} ({d['signal'] or 'sharpness, not meant'})",
                  fill=(0, 0, 0))
        for j, (sev, r) in enumerate(d["severities"].items()):
            colour = palette[j % len(palette)]
            pts = [(x0 + fpr * size, y0 + size - tpr * size) for fpr, tpr in r["roc"]]
            draw.line(pts, fill=colour, width=2)
            a = r["auc"][d["signal"] or "sharpness"]
            draw.text((x0 + size * 0.42, y0 + size - 14 * (j + 1)), f"{sev}: AUC {a:.3f}",
                      fill=colour)
        draw.text((x0, y0 + size + 2), "false-positive rate ->", fill=(90, 90, 90))
    img.save(path)


def _intent_rows(result: dict[str, Any]) -> list[str]:
    """Per deployment intent: its false positives on every set, and what it catches of each
    degradation at the severity the source documents name."""
    rows = ["deployment intents (quality.intent): false positives per set, then the share of "
            "each degradation caught (at its named severity)"]
    for name, it in result["intents"].items():
        rows.append(f"intent {name}: " + ", ".join(f"{k} < {v:g}"
                                                  for k, v in it["thresholds"].items()))
        rows += _false_positive_rows(it["false_positives"])
        caught = []
        for d_name, d in result["degradations"].items():
            r = d["severities"].get(f"{d['source']:g}")
            if r is not None:
                caught.append(f"{d_name} {r['detected_by_intent'][name]:.0%}")
        rows.append("  caught: " + ", ".join(caught))
    return rows


def _false_positive_rows(by_kind: dict[str, Any]) -> list[str]:
    """One line per kind of clean input: flagged of n, the rate, its interval, the first few."""
    rows = []
    for kind, fp in by_kind.items():
        lo, hi = fp["interval"]
        rows.append(f"  {kind:27s} {fp['flagged']:3d} / {fp['n']:3d} = {fp['rate']:6.1%} "
                    f"[{lo:5.1%}, {hi:5.1%}]  "
                    + "; ".join(fp["which"][:3]) + (" ..." if len(fp["which"]) > 3 else ""))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.quality_eval",
                                     description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out")
    parser.add_argument("--all-severities", action="store_true")
    parser.add_argument("--only", default="", metavar="NAME[,NAME]",
                        help="measure these degradations only (e.g. keystone); the false "
                        "positives and operating points are measured all the same")
    args = parser.parse_args()
    only = [n for n in args.only.split(",") if n]
    unknown = [n for n in only if n not in photos.BY_NAME]
    if unknown:
        parser.error(f"--only: no such degradation {', '.join(unknown)} (one of "
                     f"{', '.join(photos.BY_NAME)})")
    result = evaluate(only)
    print(table(result, args.all_severities))
    if not only:  # residue reads pairs of images: its own sets (bench/residue_eval.py)
        from bench import residue_eval
        result["residue"] = residue_eval.evaluate()
        print("\n" + residue_eval.table(result["residue"]))
    args.out.mkdir(parents=True, exist_ok=True)
    plot(result, args.out / "roc.png")
    for d in result["degradations"].values():
        for r in d["severities"].values():
            del r["roc"]
    (args.out / "quality_eval.json").write_text(json.dumps(result, indent=1))
    print(f"\nwrote {args.out / 'roc.png'} and {args.out / 'quality_eval.json'}")


if __name__ == "__main__":
    main()

