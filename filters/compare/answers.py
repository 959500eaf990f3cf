"""Pure comparisons of a production and a canary answer (text, tensors, status)."""

from __future__ import annotations

import json
import unicodedata
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray
from pydantic import Field

from proxy.call import Result
from proxy.strict import Strict

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


class CompareConfig(Strict):
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


def openai_text(reply: Result) -> str | None:
    """The text of an OpenAI answer (chat messages or completion texts), or None for any
    other answer."""
    if reply.wire is None or reply.wire.protocol != "openai":
        return None
    try:
        doc = json.loads(reply.wire.body)
    except ValueError:
        return None
    texts = []
    for choice in doc.get("choices") or []:
        msg = choice.get("message") if isinstance(choice, dict) else None
        text = msg.get("content") if isinstance(msg, dict) else choice.get("text")
        if isinstance(text, str):
            texts.append(text)
    return "\n".join(texts)
