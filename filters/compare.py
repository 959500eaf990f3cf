"""Canary comparison and verdict: does the canary answer like production, and may it replace it?

Guards against promoting a canary that answers differently from production while looking healthy
(fast, no errors): a re-exported model whose logits drift, a quantised build that flips the top
class, an LLM whose answers change. The ``shadow`` filter mirrors a share of a route's traffic to
the canary and hands each pair of answers to the pure functions below; a ``Verdict`` over a sliding
window of those comparisons says promote / hold / abort. Seed scenario: a canary must keep a
correctness SLI of ≥ 99.5 % agreement with production before it takes traffic, and is aborted
(mirroring and any fault experiment stopped) when agreement falls under 95 % or its p99 latency
is 1.5× production's.

No I/O here, and time comes from an injected clock: everything is tested deterministically.
"""

from __future__ import annotations

import unicodedata
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray
from pydantic import BaseModel, ConfigDict, Field, model_validator

from proxy.clock import Clock

State = Literal["collecting", "promote", "hold", "abort"]


@dataclass(frozen=True)
class Comparison:
    """One canary answer against production's answer to the same request."""

    agree: bool
    metrics: dict[str, float] = field(default_factory=dict)
    """Figures of this comparison (``max_abs``, ``cosine``, ``top1``, ``topk``, ``exact``,
    ``normalised``, ``token_f1``, ``status_match``); over several outputs, the worst of them."""
    reason: str = ""
    """Empty when they agree; else what differs, with the figure and the tolerance."""


class CompareConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["tensors", "text", "auto"] = "auto"
    """What the answers are. ``compare`` dispatches on it: ``text`` answers are strings,
    ``tensors`` answers are output name → array; ``auto`` goes by the answer's type. BYTES
    outputs of a tensor answer are compared element by element as text, unless ``tensors``
    (then byte for byte)."""
    outputs: tuple[str, ...] = ()
    """Outputs to compare. Empty: every output the primary answered (outputs only the canary
    has are ignored: a new model may add some; one it dropped is a disagreement)."""
    atol: float | None = Field(None, ge=0)
    """Largest absolute difference allowed between float elements; None: not checked."""
    cosine_min: float | None = Field(0.99, ge=-1, le=1)
    """Smallest cosine similarity allowed, per batch item (the leading axis of an output of
    rank ≥ 2; the whole output otherwise), over the flattened float64 values. None: not
    checked."""
    classification: bool = False
    """The last axis holds class scores: each row's top-1 class MUST be the same, and the
    top-k overlap |A∩B|/k is reported as the ``topk`` metric (worst row)."""
    topk: int = Field(5, ge=1)
    """k of the ``topk`` metric (capped at the number of classes)."""
    text: Literal["exact", "normalised", "token_f1"] = "normalised"
    """How text must match: byte for byte, after ``normalise``, or by token F1."""
    token_f1_min: float = Field(0.8, ge=0, le=1)
    """Smallest token F1 allowed when ``text`` is ``token_f1``."""


def normalise(text: str) -> str:
    """Unicode NFKC, case-folded, whitespace runs made one space, punctuation at the ends gone:
    ``"  Hello,\\tWORLD! "`` → ``"hello, world"``."""
    folded = unicodedata.normalize("NFKC", text).casefold()
    start, end = 0, len(folded)
    while start < end and _trimmed(folded[start]):
        start += 1
    while end > start and _trimmed(folded[end - 1]):
        end -= 1
    return " ".join(folded[start:end].split())


def _trimmed(ch: str) -> bool:
    return ch.isspace() or unicodedata.category(ch).startswith("P")


def token_f1(primary: str, canary: str) -> float:
    """F1 of the whitespace tokens of the two normalised texts, as multisets."""
    a, b = Counter(normalise(primary).split()), Counter(normalise(canary).split())
    if not a and not b:
        return 1.0
    common = sum((a & b).values())
    if common == 0:
        return 0.0
    precision, recall = common / sum(b.values()), common / sum(a.values())
    return 2 * precision * recall / (precision + recall)


def compare_text(primary: str, canary: str, cfg: CompareConfig) -> Comparison:
    metrics = {"exact": float(primary == canary),
               "normalised": float(normalise(primary) == normalise(canary)),
               "token_f1": token_f1(primary, canary)}
    if cfg.text == "exact" and not metrics["exact"]:
        return Comparison(False, metrics, f"text differs (exact match required; token F1 "
                                          f"{metrics['token_f1']:.3f})")
    if cfg.text == "normalised" and not metrics["normalised"]:
        return Comparison(False, metrics, f"text differs after normalisation (token F1 "
                                          f"{metrics['token_f1']:.3f})")
    if cfg.text == "token_f1" and metrics["token_f1"] < cfg.token_f1_min:
        return Comparison(False, metrics, f"text: token F1 {metrics['token_f1']:.3f} < "
                                          f"{cfg.token_f1_min:.3f}")
    return Comparison(True, metrics)


def compare_status(primary_ok: bool, primary_code: str, canary_ok: bool,
                   canary_code: str) -> Comparison:
    """Outcomes only: both answered, or both refused with the same code, is agreement (a canary
    that refuses what production refuses behaves the same)."""
    same = primary_ok == canary_ok and (primary_ok or primary_code == canary_code)
    if same:
        return Comparison(True, {"status_match": 1.0})
    return Comparison(False, {"status_match": 0.0},
                      f"outcome differs: primary {primary_code or 'ok'}, "
                      f"canary {canary_code or 'ok'}")


_FAMILY = {"f": "float", "i": "int", "u": "uint", "b": "bool", "O": "text", "S": "text",
           "U": "text"}
# Over several outputs a metric's worst value is kept: the lowest, except max_abs.
_WORST: dict[str, Callable[[float, float], float]] = {"max_abs": max}


def compare_tensors(primary: dict[str, NDArray[Any]], canary: dict[str, NDArray[Any]],
                    cfg: CompareConfig) -> Comparison:
    """Output by output: presence, shape and dtype kind first; then floats by ``atol`` /
    ``cosine_min`` (and top-1 for classification), integers and booleans exactly (a different
    class id or token id is a different answer), text by ``cfg.text``. BF16 travels as uint16
    bits: hand it over as float."""
    names = cfg.outputs or tuple(sorted(primary))
    metrics: dict[str, float] = {}
    reasons: list[str] = []
    for name in names:
        if name not in primary or name not in canary:
            side = "primary" if name not in primary else "canary"
            reasons.append(f"output '{name}': missing from the {side} answer")
            continue
        a, b = np.asarray(primary[name]), np.asarray(canary[name])
        if a.shape != b.shape:
            reasons.append(f"output '{name}': shape {list(b.shape)} != primary {list(a.shape)}")
            continue
        fa, fb = _FAMILY.get(a.dtype.kind, a.dtype.kind), _FAMILY.get(b.dtype.kind, b.dtype.kind)
        if fa != fb:
            reasons.append(f"output '{name}': dtype {b.dtype} ({fb}) != primary {a.dtype} ({fa})")
            continue
        if fa == "float":
            found, why = _compare_floats(name, a, b, cfg)
        elif fa == "text":
            found, why = _compare_text_elements(name, a, b, cfg)
        else:
            found, why = _exact(name, float(np.mean(a == b)) if a.size else 1.0)
        for key, value in found.items():
            metrics[key] = _WORST.get(key, min)(metrics[key], value) if key in metrics else value
        if why:
            reasons.append(why)
    return Comparison(not reasons, metrics, "; ".join(reasons))


def compare(primary: str | dict[str, NDArray[Any]], canary: str | dict[str, NDArray[Any]],
            cfg: CompareConfig) -> Comparison:
    """``compare_text`` or ``compare_tensors``, as ``cfg.kind`` (or, for ``auto``, the answers'
    type) says."""
    if isinstance(primary, str) and isinstance(canary, str) and cfg.kind != "tensors":
        return compare_text(primary, canary, cfg)
    if isinstance(primary, dict) and isinstance(canary, dict) and cfg.kind != "text":
        return compare_tensors(primary, canary, cfg)
    return Comparison(False, {}, f"answers are {type(primary).__name__} and "
                                 f"{type(canary).__name__}; compare kind is '{cfg.kind}'")


def _compare_floats(name: str, a: NDArray[Any], b: NDArray[Any],
                    cfg: CompareConfig) -> tuple[dict[str, float], str]:
    a, b = a.astype(np.float64), b.astype(np.float64)
    finite_a, finite_b = np.isfinite(a), np.isfinite(b)
    broken = int(np.count_nonzero(finite_a & ~finite_b))
    if broken:
        return {"cosine": 0.0}, (f"output '{name}': {broken} NaN/Inf values in the canary "
                                 f"where the primary is finite")
    # where the primary itself is NaN/Inf, there is nothing to hold the canary to
    valid = finite_a & finite_b
    a, b = np.where(valid, a, 0.0), np.where(valid, b, 0.0)
    max_abs = float(np.max(np.abs(a - b))) if a.size else 0.0
    cosine = float(np.min(_cosines(a, b)))
    metrics = {"max_abs": max_abs, "cosine": cosine}
    reasons: list[str] = []
    if cfg.atol is not None and max_abs > cfg.atol:
        reasons.append(f"max_abs {max_abs:.3g} > {cfg.atol:.3g}")
    if cfg.cosine_min is not None and cosine < cfg.cosine_min:
        reasons.append(f"cosine {cosine:.3f} < {cfg.cosine_min:.3f}")
    if cfg.classification and a.ndim >= 1 and a.shape[-1] > 0 and a.size:
        rows_a, rows_b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
        top1 = float(np.mean(rows_a.argmax(axis=1) == rows_b.argmax(axis=1)))
        k = min(cfg.topk, a.shape[-1])
        best_a = np.argsort(-rows_a, axis=1, kind="stable")[:, :k]
        best_b = np.argsort(-rows_b, axis=1, kind="stable")[:, :k]
        overlap = min(len(set(x.tolist()) & set(y.tolist())) for x, y in zip(best_a, best_b,
                                                                              strict=True))
        metrics |= {"top1": top1, "topk": overlap / k}
        if top1 < 1.0:
            reasons.append(f"top-1 class differs in {1 - top1:.1%} of rows")
    return metrics, (f"output '{name}': " + ", ".join(reasons)) if reasons else ""


def _cosines(a: NDArray[np.float64], b: NDArray[np.float64]) -> NDArray[np.float64]:
    """Cosine per batch item; two all-zero items agree (1), one all-zero item does not (0)."""
    if a.size == 0:
        return np.ones(1)
    rows = a.shape[0] if a.ndim >= 2 else 1
    ra, rb = a.reshape(rows, -1), b.reshape(rows, -1)
    # scale each row pair into [-1, 1] first, so squares cannot overflow float64
    scale = np.maximum(np.abs(ra).max(axis=1), np.abs(rb).max(axis=1))[:, None]
    scale[scale == 0] = 1.0
    ra, rb = ra / scale, rb / scale
    na, nb = np.linalg.norm(ra, axis=1), np.linalg.norm(rb, axis=1)
    dot = np.einsum("ij,ij->i", ra, rb)
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = dot / (na * nb)
    same = np.all(ra == rb, axis=1)  # exactly 1, not 1 - 2e-16, for identical items
    cos = np.where(same, 1.0, np.where((na == 0) | (nb == 0), 0.0, cos))
    return np.asarray(np.clip(cos, -1.0, 1.0), dtype=np.float64)


def _compare_text_elements(name: str, a: NDArray[Any], b: NDArray[Any],
                           cfg: CompareConfig) -> tuple[dict[str, float], str]:
    pairs = list(zip(a.ravel().tolist(), b.ravel().tolist(), strict=True))
    if cfg.kind == "tensors":
        return _exact(name, sum(x == y for x, y in pairs) / len(pairs) if pairs else 1.0)
    metrics: dict[str, float] = {}
    why = ""
    for x, y in pairs:
        one = compare_text(_as_text(x), _as_text(y), cfg)
        for key, value in one.metrics.items():
            metrics[key] = min(metrics.get(key, value), value)
        if not one.agree and not why:
            why = f"output '{name}': {one.reason}"
    return metrics, why


def _exact(name: str, equal: float) -> tuple[dict[str, float], str]:
    return {"exact": equal}, ("" if equal == 1.0 else
                              f"output '{name}': {equal:.1%} of elements equal (all required)")


def _as_text(x: object) -> str:
    return x.decode("utf-8", "replace") if isinstance(x, bytes | bytearray) else str(x)


class VerdictConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    window: int = Field(200, gt=0)
    """The verdict judges the last ``window`` comparisons (and as many primary self-comparisons)."""
    window_s: float | None = Field(None, gt=0)
    """Also forget samples older than this many seconds; None: only the count bounds them."""
    min_samples: int = Field(20, ge=1)
    """Below this many comparisons the state is ``collecting``; also the number of
    primary self-comparisons needed before the noise floor is used."""
    promote_agreement: float = Field(0.995, ge=0, le=1)
    """Effective agreement at or above which the canary may be promoted (the correctness SLI)."""
    abort_agreement: float = Field(0.95, ge=0, le=1)
    """Effective agreement below which the canary is aborted; in between: hold."""
    max_latency_ratio: float | None = Field(1.5, gt=0)
    """Canary p99 latency / primary p99 latency above this aborts (judged once ``min_samples``
    canary latencies are in the window). None: latency is not judged."""
    noise_floor: bool = True
    """Judge the canary against what the primary agrees with itself (see ``Verdict``), once
    ``min_samples`` primary-vs-primary comparisons are in the window."""
    min_self_agreement: float = Field(0.5, ge=0, le=1)
    """A primary that agrees with itself less than this cannot tell a good canary from a bad
    one: the verdict holds (never promotes, and aborts on latency only) while that lasts; the
    comparison's tolerances are tighter than the model's own noise."""

    @model_validator(mode="after")
    def _ordered(self) -> VerdictConfig:
        if self.abort_agreement > self.promote_agreement:
            raise ValueError(f"abort_agreement {self.abort_agreement} is above "
                             f"promote_agreement {self.promote_agreement}")
        if self.min_samples > self.window:
            raise ValueError(f"min_samples {self.min_samples} can never be reached in a window "
                             f"of {self.window}")
        return self


@dataclass(frozen=True, slots=True)
class _Sample:
    at: float
    agree: bool
    metrics: dict[str, float]
    primary_s: float
    canary_s: float | None


@dataclass(frozen=True, slots=True)
class _Figures:
    samples: int
    agreed: int
    agreement: float | None
    noise_samples: int
    self_agreement: float | None
    effective: float | None
    primary_p99_ms: float | None
    canary_p99_ms: float | None
    latency_ratio: float | None


OnChange = Callable[[State, State, list[str]], None]
_EPS = 1e-9
_DISAGREEMENTS_KEPT = 50
_BINS = 20


class Verdict:
    """Promote / hold / abort over a sliding window of comparisons, on an injected clock.

    With the noise floor on and ``min_samples`` primary-vs-primary comparisons in the window
    (``add_noise``), the effective agreement is ``min(1, agreement / max(self_agreement, ε))``:
    agreement = comparisons where the canary agreed with the primary / comparisons, and
    self_agreement = the same share for two answers of the primary to one request. A sampling
    LLM whose answers agree with themselves 90 % of the time and with a canary 90 % of the time
    has an effective agreement of 1: the canary is as consistent with production as production
    is with itself. Otherwise the effective agreement is the raw agreement. A primary that agrees
    with itself less than ``min_self_agreement`` holds the verdict: the ratio means nothing there.

    ``state``: ``collecting`` below ``min_samples``; ``abort`` below ``abort_agreement`` or past
    ``max_latency_ratio``; ``promote`` at or above ``promote_agreement``; ``hold`` in between.
    ``abort`` latches until ``reset``: the callbacks stop mirroring and fault experiments on it,
    and samples ageing out of the window MUST NOT silently turn it back into ``collecting``.
    Memory is bounded: ``window`` samples of each kind and 50 disagreement reasons.
    """

    def __init__(self, cfg: VerdictConfig, clock: Clock, expect_noise: bool = False) -> None:
        self.cfg = cfg
        self.clock = clock
        self.expect_noise = expect_noise and cfg.noise_floor
        """Self-comparisons are coming (the mirror sends some calls twice): judge nothing until
        the noise floor is known, rather than abort a non-deterministic model on raw figures."""
        self._samples: deque[_Sample] = deque(maxlen=cfg.window)
        self._noise: deque[tuple[float, bool]] = deque(maxlen=cfg.window)
        self._disagreements: deque[tuple[float, str]] = deque(maxlen=_DISAGREEMENTS_KEPT)
        self._callbacks: list[OnChange] = []
        self._state: State = "collecting"
        self._reasons: list[str] = []
        self._judge()

    def add(self, c: Comparison, primary_latency_s: float,
            canary_latency_s: float | None = None) -> None:
        """One canary comparison; ``canary_latency_s`` is None when the canary did not answer."""
        metrics = dict(c.metrics)
        if canary_latency_s is not None:
            metrics["latency_diff_ms"] = (canary_latency_s - primary_latency_s) * 1000
        self._samples.append(_Sample(self.clock.monotonic(), c.agree, metrics,
                                     primary_latency_s, canary_latency_s))
        if not c.agree:
            self._disagreements.append((self.clock.wall(), c.reason or "disagreed"))
        self._judge()

    def add_noise(self, c: Comparison) -> None:
        """One comparison of two primary answers to the same request (the noise floor)."""
        self._noise.append((self.clock.monotonic(), c.agree))
        self._judge()

    def on_change(self, callback: OnChange) -> None:
        """Call ``callback(old_state, new_state, reasons)`` on every change of state, inside the
        ``add`` / ``state`` call that saw it; it MUST NOT raise."""
        self._callbacks.append(callback)

    def state(self) -> State:
        self._judge()
        return self._state

    def reasons(self) -> list[str]:
        """Why the state is what it is (empty for ``promote``), with figures; for ``abort``,
        the figures of the moment it aborted."""
        self._judge()
        return list(self._reasons)

    def reset(self) -> None:
        """Forget every sample and un-latch an abort (an operator's decision)."""
        self._samples.clear()
        self._noise.clear()
        self._disagreements.clear()
        self._move("collecting", self._decide(self._figures())[1])

    def _prune(self) -> None:
        if self.cfg.window_s is None:
            return
        cutoff = self.clock.monotonic() - self.cfg.window_s
        while self._samples and self._samples[0].at < cutoff:
            self._samples.popleft()
        while self._noise and self._noise[0][0] < cutoff:
            self._noise.popleft()

    def _figures(self) -> _Figures:
        self._prune()
        cfg, n, n_noise = self.cfg, len(self._samples), len(self._noise)
        agreed = sum(s.agree for s in self._samples)
        agreement = agreed / n if n else None
        self_agreement = (sum(a for _, a in self._noise) / n_noise
                          if n_noise >= cfg.min_samples else None)
        effective = agreement
        if cfg.noise_floor and agreement is not None and self_agreement is not None:
            effective = min(1.0, agreement / max(self_agreement, _EPS))
        primary = [s.primary_s * 1000 for s in self._samples]
        canary = [s.canary_s * 1000 for s in self._samples if s.canary_s is not None]
        p99_p = float(np.percentile(primary, 99)) if primary else None
        p99_c = float(np.percentile(canary, 99)) if canary else None
        ratio = (p99_c / p99_p if p99_c is not None and p99_p and len(canary) >= cfg.min_samples
                 else None)
        return _Figures(n, agreed, agreement, n_noise, self_agreement, effective, p99_p, p99_c,
                        ratio)

    def _decide(self, f: _Figures) -> tuple[State, list[str]]:
        cfg = self.cfg
        if f.samples < cfg.min_samples or f.effective is None:
            return "collecting", [f"{f.samples} of {cfg.min_samples} samples collected"]
        if self.expect_noise and f.self_agreement is None:
            return "collecting", [f"waiting for the noise floor: {f.noise_samples} of "
                                  f"{cfg.min_samples} self-comparisons"]
        basis = f"the canary agreed in {f.agreed} of {f.samples}"
        if f.self_agreement is not None and cfg.noise_floor:
            basis += (f"; the primary agrees with itself {f.self_agreement:.1%} "
                      f"over {f.noise_samples}")
        elif cfg.noise_floor and f.noise_samples:
            basis += (f"; noise floor unknown yet ({f.noise_samples} of {cfg.min_samples} "
                      f"self-comparisons): raw agreement used")
        latest = ([f"latest disagreement: {self._disagreements[-1][1]}"]
                  if self._disagreements and f.agreed < f.samples else [])
        aborts: list[str] = []
        blind = (cfg.noise_floor and f.self_agreement is not None
                 and f.self_agreement < cfg.min_self_agreement)
        # A primary that mostly disagrees with itself cannot convict the canary either: with
        # such a noise floor only latency may abort.
        if f.effective < cfg.abort_agreement and not blind:
            aborts.append(f"effective agreement {f.effective:.1%} < abort threshold "
                          f"{cfg.abort_agreement:.1%} ({basis})")
        if (cfg.max_latency_ratio is not None and f.latency_ratio is not None
                and f.latency_ratio > cfg.max_latency_ratio):
            aborts.append(f"canary p99 latency {f.canary_p99_ms:.1f} ms is {f.latency_ratio:.2f}× "
                          f"the primary's {f.primary_p99_ms:.1f} ms "
                          f"(limit {cfg.max_latency_ratio:.2f}×)")
        if aborts:
            return "abort", aborts + latest
        holds: list[str] = []
        if blind:
            holds.append(f"the primary agrees with itself only {f.self_agreement:.1%} "
                         f"(< {cfg.min_self_agreement:.1%}): comparisons cannot judge the canary")
        if f.effective < cfg.promote_agreement:
            holds.append(f"effective agreement {f.effective:.1%} < promote threshold "
                         f"{cfg.promote_agreement:.1%} ({basis})")
        return ("hold", holds + latest) if holds else ("promote", [])

    def _judge(self) -> None:
        if self._state == "abort":
            return
        self._move(*self._decide(self._figures()))

    def _move(self, state: State, reasons: list[str]) -> None:
        old, self._state, self._reasons = self._state, state, reasons
        if old != state:
            for callback in list(self._callbacks):
                callback(old, state, list(reasons))

    def snapshot(self) -> dict[str, Any]:
        """JSON-able evidence for the admin API and ``mmguard canary-report``."""
        state, reasons = self.state(), self.reasons()
        f = self._figures()
        cfg = self.cfg
        names = sorted({k for s in self._samples for k in s.metrics})
        values = {k: [s.metrics[k] for s in self._samples if k in s.metrics] for k in names}
        primary = [s.primary_s * 1000 for s in self._samples]
        canary = [s.canary_s * 1000 for s in self._samples if s.canary_s is not None]
        return {
            "state": state, "reasons": reasons,
            "samples": f.samples, "agreed": f.agreed, "agreement": f.agreement,
            "noise_samples": f.noise_samples, "self_agreement": f.self_agreement,
            "effective_agreement": f.effective,
            "thresholds": {"promote_agreement": cfg.promote_agreement,
                           "abort_agreement": cfg.abort_agreement,
                           "max_latency_ratio": cfg.max_latency_ratio,
                           "min_samples": cfg.min_samples, "window": cfg.window,
                           "window_s": cfg.window_s},
            "metrics": {k: q for k in names if (q := _quantiles(values[k]))},
            "latency_ms": {"primary": _quantiles(primary, (50, 99)),
                           "canary": _quantiles(canary, (50, 99)),
                           "p99_ratio": f.latency_ratio},
            "disagreements": [{"at": at, "reason": why} for at, why in self._disagreements],
            "histograms": {"metrics": {k: h for k in names if (h := _histogram(values[k]))},
                           "latency_ms": _latency_histogram(primary, canary)},
        }


def _finite(values: list[float]) -> NDArray[np.float64]:
    arr = np.asarray(values, dtype=np.float64)
    return np.asarray(arr[np.isfinite(arr)], dtype=np.float64)


def _quantiles(values: list[float], ps: tuple[int, ...] = (50, 90, 99)) -> dict[str, float]:
    arr = _finite(values)
    if not arr.size:
        return {}
    found = {f"p{p}": float(q) for p, q in zip(ps, np.percentile(arr, ps), strict=True)}
    return found | ({"min": float(arr.min()), "max": float(arr.max())} if len(ps) > 2 else {})


def _histogram(values: list[float]) -> dict[str, list[float]]:
    arr = _finite(values)
    if not arr.size:
        return {}
    counts, edges = np.histogram(arr, bins=_BINS)
    return {"edges": edges.tolist(), "counts": counts.tolist()}


def _latency_histogram(primary: list[float], canary: list[float]) -> dict[str, list[float]]:
    """Primary and canary latencies over the same bin edges, so one plot can overlay them."""
    p, c = _finite(primary), _finite(canary)
    if not p.size and not c.size:
        return {}
    edges = np.histogram_bin_edges(np.concatenate([p, c]), bins=_BINS)
    return {"edges": edges.tolist(), "primary": np.histogram(p, edges)[0].tolist(),
            "canary": np.histogram(c, edges)[0].tolist()}
