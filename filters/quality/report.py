"""What one request's inputs scored: every scored item, the alignment, what was not scored.

The ``quality`` filter builds a ``Report`` (in a worker thread when it is heavy), then reads it on
the event loop: the score a rule looks at (``find``), one header's worth of scores (``summary``)
and the series drift watches (``series``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from filters.quality.residue import Trace
from filters.quality.signals import (
    IMAGE_SIGNALS,
    REQUEST_SIGNALS,
    Signal,
    fmt_value,
    modality_score,
    trust_score,
)
from filters.quality.text import TEXT_SIGNALS

_IMAGE = (*IMAGE_SIGNALS, *REQUEST_SIGNALS)
_HEADER_ORDER = (*(("image", n) for n in _IMAGE), *(("text", n) for n in TEXT_SIGNALS))
"""The signals in the order the scores' header lists them."""
_AT_ONE = {key: f"{key[1]}={1.0:.3f}" for key in _HEADER_ORDER}
"""A signal at 1.0 in the header, written once: most signals of a clean input read 1.0, and
formatting each of them on every request was most of the header's cost."""
_PUBLISHED = {name: f"quality.{name}" for name in (*_IMAGE, *TEXT_SIGNALS)}
"""A signal's name among the published scores."""
MODALITY_OF = {**dict.fromkeys(_IMAGE, "image"), **dict.fromkeys(TEXT_SIGNALS, "text")}
"""A signal's modality (a signal name belongs to one)."""


@dataclass(slots=True)
class Item:
    """One scored input: an image or a text, with where it was in the request."""

    modality: str  # image | text
    where: str
    signals: dict[str, Signal]
    param: str | None = None  # OpenAI: the request field, for the error's 'param'
    score: float = field(init=False)
    weakest: str = field(init=False)

    def __post_init__(self) -> None:
        self.score, self.weakest = modality_score(self.signals)


@dataclass(frozen=True, slots=True)
class Finding:
    """A score a rule looks at, with a sentence that says where it came from."""

    score: float
    modality: str  # image | text | "" (alignment, trust)
    detail: str
    param: str | None = None


@dataclass
class Report:
    """Every score of one request: items, alignment per image–text pair, and what was not
    scored (and why)."""

    items: list[Item] = field(default_factory=list)
    unscored: list[str] = field(default_factory=list)
    alignment: NDArray[np.float32] | None = None
    alignment_where: str = ""
    alignment_error: str = ""
    traces: list[tuple[str, Trace | None]] = field(default_factory=list)
    """Where residue is measured: the request's last ``residue.WINDOW`` images' traces, by
    their place in the request (what a stream or a named client keeps for its next request)."""
    _parts: dict[str, float | None] | None = field(default=None, init=False, repr=False)
    _lows: dict[tuple[str, str], float] | None = field(default=None, init=False, repr=False)
    _trust: tuple[Mapping[str, float], float | None] | None = field(default=None, init=False,
                                                                   repr=False)

    def add(self, item: Item) -> None:
        self.items.append(item)
        self._parts = self._lows = self._trust = None

    def lows(self) -> dict[tuple[str, str], float]:
        """(modality, signal) -> the lowest score over the items, in the order the signals
        first appear: read by every rule, the header, the published scores (computed once per
        report, where each of them used to walk the items)."""
        if self._lows is None:
            lows: dict[tuple[str, str], float] = {}
            for item in self.items:
                for name, s in item.signals.items():
                    key = (item.modality, name)
                    low = lows.get(key)
                    if low is None or s.score < low:
                        lows[key] = s.score
            self._lows = lows
        return self._lows

    def set_alignment(self, scores: NDArray[np.float32], where: str) -> None:
        self.alignment, self.alignment_where = scores, where
        self._parts = self._trust = None

    def worst(self, modality: str, signal: str | None = None) -> Item | None:
        found = [i for i in self.items if i.modality == modality
                 and (signal is None or signal in i.signals)]
        if not found:
            return None
        if signal is None:
            return min(found, key=lambda i: i.score)
        return min(found, key=lambda i: i.signals[signal].score)

    def parts(self) -> dict[str, float | None]:
        """visual, text and alignment: the scores the trust score weighs (computed once per
        report: the header, the published scores, drift and the rules all read them)."""
        return dict(self._part_scores())

    def _part_scores(self) -> dict[str, float | None]:
        """``parts`` itself, not a copy (for this class's readers, which never change it)."""
        if self._parts is None:
            image, text = self.worst("image"), self.worst("text")
            self._parts = {"visual": None if image is None else image.score,
                           "text": None if text is None else text.score,
                           "alignment": None if self.alignment is None
                           else float(self.alignment.min())}
        return self._parts

    def trust(self, weights: Mapping[str, float]) -> float | None:
        """``trust_score(parts, weights)``, computed once per report and weights (the header,
        the published scores, drift, the rules and the graded actions each read it). The
        weights are told apart by identity: a filter's never change while it lives."""
        found = self._trust
        if found is None or found[0] is not weights:
            found = self._trust = (weights, trust_score(self._part_scores(), weights))
        return found[1]

    def score(self, signal: str, weights: Mapping[str, float]) -> float | None:
        """The score ``find`` would give, without its sentence (None when absent)."""
        modality = MODALITY_OF.get(signal)
        if modality is not None:
            return self.lows().get((modality, signal))
        if signal in ("image", "text"):
            scores = [i.score for i in self.items if i.modality == signal]
            return min(scores) if scores else None
        if signal == "alignment":
            return None if self.alignment is None else float(self.alignment.min())
        return self.trust(weights)

    def find(self, signal: str, weights: Mapping[str, float]) -> Finding | None:
        """The score a rule on ``signal`` reads (the worst item's), or None when absent."""
        modality = MODALITY_OF.get(signal)
        if modality is not None:
            item = self.worst(modality, signal)
            if item is None:
                return None
            s = item.signals[signal]
            return Finding(s.score, modality, f"{item.where}: signal '{signal}' is "
                           f"{s.score:.3f} ({fmt_value(s.value)} {s.what})", item.param)
        if signal in ("image", "text"):
            item = self.worst(signal)
            if item is None:
                return None
            s = item.signals[item.weakest]
            return Finding(item.score, signal, f"{item.where}: {signal} score is "
                           f"{item.score:.3f} (weakest signal '{item.weakest}': "
                           f"{fmt_value(s.value)} {s.what})", item.param)
        if signal == "alignment":
            if self.alignment is None:
                return None
            low = float(self.alignment.min())
            return Finding(low, "", f"{self.alignment_where}: alignment is {low:.3f}")
        trust = self.trust(weights)
        if trust is None:
            return None
        parts = " ".join(f"{k}={v:.3f}" for k, v in self.parts().items() if v is not None)
        return Finding(trust, "", f"trust score is {trust:.3f} ({parts})")

    def summary(self, weights: Mapping[str, float]) -> str:
        """trust, modality scores, then each signal's worst score: one header's worth."""
        parts = self._part_scores()
        head = [("trust", self.trust(weights)), ("image", parts["visual"]),
                ("text", parts["text"]), ("alignment", parts["alignment"])]
        out = [f"{k}={v:.3f}" for k, v in head if v is not None]
        lows = self.lows()
        for key in _HEADER_ORDER:
            low = lows.get(key)
            if low is not None:
                out.append(_AT_ONE[key] if low == 1.0 else f"{key[1]}={low:.3f}")
        return " ".join(out)

    def published(self, weights: Mapping[str, float]) -> dict[str, float]:
        """What the filter publishes on the call (``proxy.call.SCORES``) for canary
        eligibility: ``quality.<score>`` for trust, image, text, alignment (the lowest pair)
        and every signal (the worst item's), those the request has."""
        parts = self._part_scores()
        head = {"trust": self.trust(weights), "image": parts["visual"],
                "text": parts["text"], "alignment": parts["alignment"]}
        out = {f"quality.{k}": v for k, v in head.items() if v is not None}
        for (_, name), low in self.lows().items():
            key = _PUBLISHED.get(name) or f"quality.{name}"
            out[key] = min(out.get(key, 1.0), low)
        return out

    def series(self, weights: Mapping[str, float]) -> Iterator[tuple[str, str, float]]:
        """(modality, signal, score) for drift: every item's signals and score, every aligned
        pair, and the trust score."""
        for item in self.items:
            for name, s in item.signals.items():
                yield item.modality, name, s.score
            yield item.modality, "score", item.score
        if self.alignment is not None:
            for value in self.alignment.tolist():
                yield "image-text", "alignment", float(value)
        trust = self.trust(weights)
        if trust is not None:
            yield "all", "trust", trust
