"""``quality``: score every image and text input, live and cheaply, and act on the score.

Guards against a model answering confidently on garbage. Seed scenarios: low-light frames
(Gaussian σ = 0.08, PSNR 22 dB), blurred or resolution-collapsed images, OCR residue, garbled or
mixed-script text, FP16 NaN/Inf, an image that has nothing to do with its caption. The signals
are in ``signals`` (image) and ``text`` (text), each a score in [0, 1]; the
optional image–text alignment in ``align``, drift in ``drift``, the per-request
``Report`` in ``report``; this module reads the inputs, builds the scores and applies
the route's rules.

Scores: each signal in [0, 1]; a modality's score is its weakest signal over all its items (one
broken property or one broken image makes the modality unusable); the trust score is the
weighted mean of visual, text and alignment (default 0.4 / 0.3 / 0.3, the seeds' IQE), with the
weights renormalised over the parts a request has.

Actions, per rule ``{signal, below, action}`` (fires when the score is below the threshold):

- ``annotate``: the ``mmguard-quality-<signal>`` header says which signal, its value and where;
- ``reject``: 422 / INVALID_ARGUMENT naming the signal, its value and the threshold;
- ``drop-modality``: the modality is marked unusable on the call (``UNUSABLE_MODALITIES``) for a
  router to serve without it; the request goes on.

The default rules refuse NaN/Inf and annotate on the image signals, each at the threshold its ROC
on real photographs gives for at most 1 % false alarms on clean photographs and random crops of
them (docs/quality.md has the figures). Every score is published on the call
(``proxy.call.publish_scores``: ``quality.alignment``, ``quality.trust``, ``quality.<signal>``)
for ``canary.eligible``.
With ``graded`` set, the trust score drives the seeds' bands as well (``graded``: below
0.3 refused with the fallback answer, 0.3-0.7 a share shed to a cheaper route or the cached
answer, from 0.7 observed). OpenAI images are decoded reduced, under the process-wide decode
budget (``proxy.wire.image_decode``).

With ``annotate: true`` every scored request also carries ``mmguard-quality-scores`` (trust,
modalities, each signal). ``sample`` scores only a share of requests (drawn from ``ctx.rng``).
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections import deque
from collections.abc import Iterable
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray
from prometheus_client import CollectorRegistry, Gauge
from pydantic import Field, model_validator

from filters.call_keys import UNUSABLE_MODALITIES, touched_by_fault
from filters.quality import native
from filters.quality.align import AlignmentConfig, AlignmentUnavailable, EncoderPair
from filters.quality.drift import DriftConfig, DriftMonitor, drift_gauges
from filters.quality.graded import GradedActions, GradedConfig, trust_detail
from filters.quality.report import MODALITY_OF, Finding, Item, Report
from filters.quality.residue import WINDOW, Trace, residue, trace
from filters.quality.rules import DEFAULT_RULES, Intent, Rule, rules_of
from filters.quality.scenes import OPTIONAL_SIGNALS
from filters.quality.signals import (
    REF_SIDE,
    ImageSpec,
    Signal,
    measure_image,
)
from filters.quality.stream_frames import Earlier, remember, watch_kept
from filters.quality.text import char_tables, text_signals
from proxy.call import (
    STREAM_MEMORY,
    Api,
    Call,
    LocalReply,
    Reply,
    publish_scores,
)
from proxy.chain import FilterContext, Next
from proxy.errors import ErrorKind
from proxy.lifecycle import FilterFactoryBase
from proxy.pod.state import share
from proxy.strict import Strict
from proxy.tensor import Tensor, decode_bytes_elements
from proxy.wire.openai import ChatView

log = logging.getLogger("mmguard.quality")
NAME = "quality"
_INLINE_BYTES = 1 << 20  # above this, v2 images are measured in a worker thread
_HWC_RGB = ImageSpec("HWC", (0.0,), (255.0,))  # decoded OpenAI images
_IMAGE_TYPES = ("FP32", "FP16", "FP64", "BF16", "UINT8")
_UNPRINTABLE = {c: "?" for c in (*range(0x20), 0x7F)}


class ImageInput(Strict):
    layout: Literal["auto", "NCHW", "NHWC", "CHW", "HWC", "HW"] = "auto"
    """Where the channels are; 'auto' reads it from the shape (a dim of 1, 3 or 4)."""
    range: tuple[float, float] | None = None
    """The values the model expects; default [0, 255] for UINT8, [0, 1] for floats."""
    mean: tuple[float, ...] | None = None
    """Mean/std-normalised input: per-channel mean and std (the expected range follows)."""
    std: tuple[float, ...] | None = None

    @model_validator(mode="after")
    def _check(self) -> ImageInput:
        if (self.mean is None) != (self.std is None):
            raise ValueError("mean and std go together")
        if self.mean is not None and self.std is not None:
            if self.range is not None:
                raise ValueError("give either range or mean/std, not both")
            if len(self.mean) != len(self.std) or any(s <= 0 for s in self.std):
                raise ValueError("mean and std need the same length and std > 0")
        if self.range is not None and self.range[0] >= self.range[1]:
            raise ValueError("range must be [low, high] with low < high")
        return self

    def spec(self, layout: str, datatype: str) -> ImageSpec:
        if self.mean is not None and self.std is not None:
            return ImageSpec(layout, tuple(-m / s for m, s in zip(self.mean, self.std,
                                                                   strict=True)),
                             tuple((1 - m) / s for m, s in zip(self.mean, self.std, strict=True)))
        lo, hi = self.range or ((0.0, 255.0) if datatype == "UINT8" else (0.0, 1.0))
        return ImageSpec(layout, (lo,), (hi,))


class TextInput(Strict):
    min_chars: int = Field(1, ge=0)
    max_chars: int = Field(20000, gt=0)


class Weights(Strict):
    visual: float = Field(0.4, ge=0)
    text: float = Field(0.3, ge=0)
    alignment: float = Field(0.3, ge=0)


Windows = tuple["deque[tuple[str, Trace | None]]", "deque[tuple[str, Trace | None]]"]
"""With residue on: the images before the next one (a stream's earlier ones first), and this
request's last ``WINDOW`` (what its stream or client keeps)."""


class QualityConfig(Strict):
    images: dict[str, ImageInput] = Field(default_factory=dict)
    """v2: the inputs that are images, and how to read them."""
    texts: dict[str, TextInput] = Field(default_factory=dict)
    """v2: the BYTES inputs that are text."""
    chat: TextInput = TextInput()
    """OpenAI requests: limits for their texts (images are decoded and always scored)."""
    intent: Intent = "photos"
    """Which rule set a route gets when it lists no ``rules``, each read off the ROC of every
    signal on real photographs (docs/quality.md, "Deployment intents", has what each catches
    and flags): 'photos' (the default): NaN/Inf refused and every image signal annotating at
    the highest threshold that flags none of the clean photographs and random crops; 'recall':
    each signal at the threshold that flags at most 1 % of them on its own (more caught, more
    alarms: documents and dark-mode screenshots among them); 'screens': the defaults plus
    moiré and ghosting (users who send phone pictures of screens, and OCR residue)."""
    rules: tuple[Rule, ...] = DEFAULT_RULES
    """The rules in full, instead of the intent's (give one or the other). 'ghosting',
    'moire' and 'washout' (the dearest signals) are measured only when a rule names them."""
    annotate: bool = True
    """Send mmguard-quality-scores (trust, modalities, signals) on every scored request."""
    sample: float = Field(1.0, ge=0.0, le=1.0)
    """Share of requests scored at all."""
    weights: Weights = Weights()
    alignment: AlignmentConfig | None = None
    drift: DriftConfig | None = DriftConfig()
    """Drift of every signal against a baseline; null turns it off."""
    graded: GradedConfig | None = None
    """Confidence-graded actions on the trust score (refuse / shed / observe); off when unset."""

    _intent = model_validator(mode="before")(rules_of)

    @model_validator(mode="after")
    def _check(self) -> QualityConfig:
        both = set(self.images) & set(self.texts)
        if both:
            raise ValueError(f"inputs cannot be both image and text: {sorted(both)}")
        a = self.alignment
        if a is not None and a.image_input is not None and a.image_input not in self.images:
            raise ValueError(f"alignment.image_input '{a.image_input}' is not in images")
        if a is None and any(r.signal == "alignment" for r in self.rules):
            raise ValueError("a rule on 'alignment' needs the alignment section")
        return self


def resolve_layout(shape: tuple[int, ...], layout: str) -> tuple[str, bool] | None:
    """(per-image layout CHW/HWC/HW, batched) for a tensor shape, or None if it fits no image."""
    if layout != "auto":
        inner = layout.removeprefix("N")
        rank = len(inner) + (layout.startswith("N"))
        return (inner, layout.startswith("N")) if len(shape) == rank else None
    if len(shape) == 2:
        return "HW", False
    if len(shape) not in (3, 4):
        return None
    batched = len(shape) == 4
    dims = shape[1:] if batched else shape
    if dims[0] in (1, 3, 4):
        return "CHW", batched
    if dims[-1] in (1, 3, 4):
        return "HWC", batched
    return None


def _pixels(t: Tensor) -> NDArray[Any]:
    arr = t.numpy()
    if t.datatype == "BF16":  # bfloat16 travels as uint16 bits: widen to float32
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr


class Quality:
    def __init__(self, cfg: QualityConfig, ctx: FilterContext) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self._stream_key = f"quality/residue/{ctx.route}"
        self.pair = EncoderPair(cfg.alignment) if cfg.alignment is not None else None
        self.drift = (DriftMonitor(ctx.route, cfg.drift, drift_gauges(ctx.telemetry.registry))
                      if cfg.drift is not None else None)
        if self.drift is not None:
            drift = self.drift
            ctx.on_activate(lambda: share(drift, f"drift/input/{ctx.route}"))
        self.graded = (GradedActions(cfg.graded, ctx, self._decide)
                       if cfg.graded is not None else None)
        w = cfg.weights
        self.weights = {"visual": w.visual, "text": w.text, "alignment": w.alignment}
        self.optional = frozenset(r.signal for r in cfg.rules) & OPTIONAL_SIGNALS
        """The dear signals measured on this route: those a rule names."""
        self._rules = [(r, (MODALITY_OF[r.signal], r.signal) if r.signal in MODALITY_OF
                        else None) for r in cfg.rules]
        """Each rule with the (modality, signal) whose lowest score it reads; None for the
        modality scores, alignment and trust (``Report.score`` reads those)."""
        self._specs: dict[tuple[str, str, str], ImageSpec] = {}
        """(input, layout, datatype) -> how its images are read (the config's, made once)."""
        char_tables()  # build the text tables now, not on the first request

    def _decide(self, call: Call, header: str, decision: str, detail: str) -> None:
        # Details name client-chosen inputs; header and trailer values must be printable ASCII.
        # (A detail that is already printable ASCII, as most are, is left as it is: escaping
        # and translating it would change nothing, at ~10 µs for the scores' header.)
        safe = detail if detail.isascii() and detail.isprintable() else (
            detail.encode("ascii", "backslashreplace").decode().translate(_UNPRINTABLE))
        self.ctx.telemetry.decide(call, NAME, decision, safe, header=header)

    async def __call__(self, call: Call, next: Next) -> Reply:
        rng = self.ctx.rng
        if self.cfg.sample < 1.0 and rng.random() >= self.cfg.sample:
            self._decide(call, "scores", "unsampled", f"scored share {self.cfg.sample:g}")
            return await next(call)
        align = self.pair is not None and (self.pair.cfg.sample >= 1.0
                                           or rng.random() < self.pair.cfg.sample)
        memory = call.state.get(STREAM_MEMORY) if "residue" in self.optional else None
        earlier: Earlier | None = memory.get(self._stream_key) if memory is not None else None
        if self._heavy(call, align):
            report = await asyncio.to_thread(self.measure, call, align, earlier)
        else:
            report = self.measure(call, align, earlier)
        if memory is not None:
            remember(memory, self._stream_key, earlier, report)
        self._announce(call, report)
        publish_scores(call, report.published(self.weights))
        if not touched_by_fault(call):  # a fault that perturbed the input is not drift
            await self._observe(report)
        refusal = self._apply_rules(call, report)
        if refusal is not None:
            return refusal
        trust = report.trust(self.weights) if self.graded is not None else None
        if self.graded is not None and trust is not None:
            return await self.graded.apply(call, trust, trust_detail(trust, report.parts()), next)
        return await next(call)

    def _heavy(self, call: Call, align: bool) -> bool:
        """Measure in a worker thread when it could hold the event loop for long: encoders,
        image decoding (OpenAI), or large tensors."""
        if align:
            return True
        if call.api is Api.OPENAI:
            return bool(ChatView(call).images())
        return sum(t.nbytes for t in call.inputs if t.name in self.cfg.images) > _INLINE_BYTES

    # --- measuring (pure: may run in a worker thread) ---------------------------------------

    def measure(self, call: Call, align: bool, earlier: Earlier | None = None) -> Report:
        """The request's scores; ``earlier``: the images a stream's requests before this one
        left for residue to compare with."""
        report = Report()
        traces: Windows | None = None
        if "residue" in self.optional:  # the images before each one, and this request's last
            before: Iterable[tuple[str, Trace | None]] = earlier.traces if earlier else ()
            traces = deque(before, maxlen=WINDOW), deque(maxlen=WINDOW)
        if call.api is Api.OPENAI:
            rgbs = self._measure_chat(call, report, traces)
            if align and rgbs:
                self._align_chat(report, rgbs, ChatView(call).texts())
        else:
            for t in call.inputs:
                if t.name in self.cfg.images:
                    self._measure_images(t, self.cfg.images[t.name], report, traces)
                elif t.name in self.cfg.texts:
                    self._measure_texts(t, self.cfg.texts[t.name], report)
            if align:
                self._align_v2(call, report)
        if traces is not None:
            report.traces = list(traces[1])
        return report

    def _image_item(self, where: str, measured: tuple[dict[str, Signal], Any],
                    traces: Windows | None, param: str | None = None) -> Item:
        """An image's item; with residue on, the image is compared with the ``WINDOW`` images
        before it, then takes its place among them (only a window is ever held: a batch of
        thousands of small images keeps four traces, not thousands)."""
        signals, plane = measured
        if traces is not None:
            window, mine = traces
            t = trace(plane)
            found = residue(t, window)
            if found is not None:
                signals["residue"] = found
            window.append((where, t))
            mine.append((where, t))
        return Item("image", where, signals, param)

    def _measure_images(self, t: Tensor, cfg: ImageInput, report: Report,
                        traces: Windows | None) -> None:
        if t.datatype not in _IMAGE_TYPES:
            report.unscored.append(f"input '{t.name}' is {t.datatype}, not an image datatype")
            return
        found = resolve_layout(t.shape, cfg.layout)
        if found is None:
            report.unscored.append(f"input '{t.name}' has shape {list(t.shape)}, which is not "
                                   f"a {cfg.layout} image")
            return
        layout, batched = found
        key = (t.name, layout, t.datatype)
        spec = self._specs.get(key)
        if spec is None:  # the same few per route: made once, not per call
            spec = self._specs[key] = cfg.spec(layout, t.datatype)
        pixels = _pixels(t)
        images = list(pixels) if batched else [pixels]
        for i, image in enumerate(images):
            where = f"input '{t.name}' image {i}" if batched else f"input '{t.name}'"
            report.add(self._image_item(where, measure_image(image, spec, self.optional),
                                        traces))

    def _measure_texts(self, t: Tensor, cfg: TextInput, report: Report) -> None:
        if t.datatype != "BYTES":
            report.unscored.append(f"input '{t.name}' is {t.datatype}, not BYTES text")
            return
        items = decode_bytes_elements(t.raw_bytes(), t.elements, t.name)
        for i, raw in enumerate(items):
            text = raw.decode("utf-8", "surrogateescape")  # bad bytes count as invalid chars
            where = f"input '{t.name}' text {i}" if len(items) > 1 else f"input '{t.name}'"
            report.add(Item("text", where, text_signals(text, cfg.min_chars, cfg.max_chars)))

    def _measure_chat(self, call: Call, report: Report,
                      traces: Windows | None) -> list[NDArray[np.uint8]]:
        view = ChatView(call)
        for i, text in enumerate(view.texts()):
            report.add(Item("text", f"text {i}", text_signals(
                text, self.cfg.chat.min_chars, self.cfg.chat.max_chars)))
        rgbs = []
        for image in view.images():
            if not image.url.startswith("data:"):
                report.unscored.append(f"{image.param} is a remote URL")
                continue
            rgb = image.array(max_side=REF_SIDE)  # reduced while decoding: never full size
            report.add(self._image_item(
                image.param, measure_image(rgb, _HWC_RGB, self.optional), traces, image.param))
            rgbs.append(rgb)
        return rgbs

    def _align_v2(self, call: Call, report: Report) -> None:
        assert self.pair is not None
        a = self.pair.cfg
        image_name = a.image_input or (next(iter(self.cfg.images))
                                       if len(self.cfg.images) == 1 else None)
        text_name = a.text_input or (next(iter(self.cfg.texts))
                                     if len(self.cfg.texts) == 1 else None)
        image = call.input(image_name) if image_name else None
        text = call.input(text_name) if text_name else None
        if image is None or text is None:
            return  # a request without both has nothing to align
        try:
            img = self.pair.embed_images(_pixels(image))
            if text.datatype == "BYTES":
                items = decode_bytes_elements(text.raw_bytes(), text.elements, text.name)
                txt = self.pair.embed_texts([b.decode("utf-8", "replace") for b in items])
            else:
                txt = self.pair.embed_ids(text.numpy())
            report.set_alignment(self.pair.scores(self.pair.cosines(img, txt)),
                                 f"inputs '{image.name}' and '{text.name}'")
        except AlignmentUnavailable as exc:
            report.alignment_error = str(exc)

    def _align_chat(self, report: Report, rgbs: list[NDArray[np.uint8]],
                    texts: list[str]) -> None:
        assert self.pair is not None
        if not texts:
            return
        try:
            img = self.pair.embed_images(np.concatenate([self.pair.prepare_rgb(r)
                                                         for r in rgbs]))
            txt = self.pair.embed_texts(["\n".join(texts)])
            report.set_alignment(self.pair.scores(self.pair.cosines(img, txt)),
                                 "the images and the texts")
        except AlignmentUnavailable as exc:
            report.alignment_error = str(exc)

    # --- acting (on the event loop) ---------------------------------------------------------

    def _announce(self, call: Call, report: Report) -> None:
        if report.unscored:
            self._decide(call, "unscored", "unscored", "; ".join(report.unscored))
        if report.alignment_error:
            self._decide(call, "alignment", "unscored", report.alignment_error)
        if self.cfg.annotate and (report.items or report.alignment is not None):
            self._decide(call, "scores", "scored", report.summary(self.weights))

    async def _observe(self, report: Report) -> None:
        monitor = self.drift
        if monitor is None:
            return
        monitor.observe_all([(m, s, float(v)) for m, s, v in report.series(self.weights)])
        if monitor.dirty and monitor.cfg.baseline_file is not None:
            monitor.dirty = False
            try:
                await asyncio.to_thread(monitor.save, monitor.snapshot())
            except OSError as exc:
                log.warning("quality: cannot save the drift baseline to %s: %s",
                            monitor.cfg.baseline_file, exc)

    def _apply_rules(self, call: Call, report: Report) -> LocalReply | None:
        rejects: list[tuple[Rule, Finding]] = []
        lows = report.lows()
        for rule, key in self._rules:
            score = lows.get(key) if key is not None else report.score(rule.signal, self.weights)
            if score is None or score >= rule.below:
                continue  # most rules on most calls: no sentence to write
            found = report.find(rule.signal, self.weights)
            assert found is not None and found.score == score
            detail = f"{found.detail}; threshold {rule.below:g}"
            if rule.action == "reject":
                rejects.append((rule, found))
            elif rule.action == "drop-modality":
                unusable = call.state.get(UNUSABLE_MODALITIES)
                if unusable is None:
                    unusable = call.state[UNUSABLE_MODALITIES] = {}
                unusable[found.modality] = detail
                self._decide(call, rule.signal, "drop-modality", detail)
            else:
                self._decide(call, rule.signal, "annotate", detail)
        for rule, found in rejects:
            self._decide(call, rule.signal, "reject", f"{found.detail}; threshold {rule.below:g}")
        if not rejects:
            return None
        rule, found = rejects[0]
        return LocalReply(ErrorKind.UNPROCESSABLE, f"quality: {found.detail}, below the "
                          f"threshold {rule.below:g}", param=found.param)


_PASSES: weakref.WeakKeyDictionary[CollectorRegistry, Gauge] = weakref.WeakKeyDictionary()


def _passes_gauge(registry: CollectorRegistry) -> Gauge:
    """The registry's one ``mmguard_quality_image_passes`` gauge (prometheus-client refuses a
    second registration of a name)."""
    gauge = _PASSES.get(registry)
    if gauge is None:
        gauge = _PASSES[registry] = Gauge(
            "mmguard_quality_image_passes", "1 for the code that measures a route's images: "
            "passes=\"c\" (filters/quality/_kernels.c) or \"numpy\" (the fallback, ~3x the CPU).",
            ["model", "passes"], multiprocess_mode="livemostrecent", registry=registry)
    return gauge


class QualityFactory(FilterFactoryBase):
    name = NAME
    config_model = QualityConfig

    def build(self, config: QualityConfig, ctx: FilterContext) -> Quality:
        if any(r.signal == "residue" for r in config.rules):
            watch_kept(ctx.telemetry)
        # Once per route at load, never per request: which code measures the images, as a
        # metric (an alert can find the pods that pay ~3x) and, when it is the slower one, a log.
        passes = "c" if native.kernels is not None else "numpy"
        _passes_gauge(ctx.telemetry.registry).labels(ctx.route, passes).set(1)
        if native.kernels is None:
            log.info("quality on route %s: the C module filters.quality._kernels is not built "
                     "(no C compiler at install?) or MMGUARD_QUALITY_KERNELS=0; the image "
                     "signals run on numpy: the same values, ~3x the CPU", ctx.route)
        return Quality(config, ctx)
