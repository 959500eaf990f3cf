"""What the quality filter costs: each signal per 224×224 image and per 1 KB text, and the
whole filter per request, on one core.

    python -m bench.quality [--n 400] [--cpu 0]
    python -m bench.quality --against /path/to/older/checkout [--rounds 9] [--optional moire]

The process pins itself to one CPU and sets BLAS to one thread before numpy loads, so "µs" means
µs of one core. Part 1 times each image signal on a 224×224 picture in the three layouts and
dtypes a request brings (FP32 NCHW, FP16 NCHW, UINT8 HWC as a decoded OpenAI image), then each
text signal on 1 KB of text. Part 2 times the filter itself in-process (``Quality.__call__``
with a no-op backend: reading the tensor, every signal, the rules, the headers, drift), on v2
image, v2 text and OpenAI image (PNG decode included) requests. Part 3 runs the same image
request through a real mmguard (gRPC front, in-process ONNX Runtime clip_demo) with and without
the filter and prints the median latencies. Each number in parts 1 and 2 is the median of 7 runs
of ``--n`` calls, in CPU time of this process (``time.process_time``), so a busy machine slows
the run, not the figure.

``--against DIR`` compares instead: ``image_signals`` of this checkout and of the one at ``DIR``
(its ``filters`` package imported beside this one), alternated round by round on the three
inputs, with each side's median and range of ``--rounds`` rounds, and the process over the
thread CPU of the run (above 1: a BLAS or other thread spun beside the caller). With
``--optional``, the opt-in signals it names are measured too (on both sides).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# One core means one BLAS thread too: set before numpy is imported.
for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")

import asyncio  # noqa: E402
import base64  # noqa: E402
import io  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
from numpy.typing import NDArray  # noqa: E402

from filters.quality import scenes  # noqa: E402
from filters.quality import signals as qs  # noqa: E402
from filters.quality import text as qt  # noqa: E402
from filters.quality import values as qv  # noqa: E402
from filters.quality.differences import differences  # noqa: E402
from filters.quality.filter import Quality, QualityConfig  # noqa: E402
from filters.quality.measure import levels  # noqa: E402
from filters.quality.residue import overlap, trace  # noqa: E402
from filters.quality.rules import DEFAULT_RULES, SCREEN_RULES  # noqa: E402
from filters.quality.washout import washout  # noqa: E402
from proxy.call import Call, Reply, Result, Target  # noqa: E402
from proxy.chain import FilterContext  # noqa: E402
from proxy.clock import SystemClock  # noqa: E402
from proxy.telemetry import Telemetry  # noqa: E402
from proxy.tensor import Tensor, encode_bytes_elements  # noqa: E402
from tests.support.images import scene  # noqa: E402
from tests.support.mmguard import RunningMmguard  # noqa: E402
from tests.support.models import ort_repository  # noqa: E402
from tests.support.wire import grpc_infer_raw, grpc_request  # noqa: E402

TEXT_1KB = ("A small red bicycle leans against a brick wall in the late afternoon sun; a cat "
            "sleeps on the step beside it, and two people talk near the door of the cafe. ")
TEXT_1KB = (TEXT_1KB * (1024 // len(TEXT_1KB) + 1))[:1024]


def picture(size: int = 224, seed: int = 0) -> NDArray[np.uint8]:
    """A real photograph (scikit-image's astronaut, resized as a client would) when the test
    extra is installed; else the tests' scene with mild noise."""
    try:
        from tests.support.photos import clean_set
        if size == 224:
            return next(c.image for c in clean_set() if c.name == "astronaut")
    except ImportError:
        pass
    img = scene(size, seed) / 255.0
    img += np.random.default_rng(seed).normal(0, 0.01, img.shape)
    return np.asarray(np.clip(img, 0, 1) * 255 + 0.5, np.uint8)


def per_call_us(fn: Callable[[], object], n: int) -> float:
    fn()
    runs = []
    for _ in range(7):
        start = time.process_time()  # CPU time: on a busy machine, wall time is the others'
        for _ in range(n):
            fn()
        runs.append((time.process_time() - start) / n * 1e6)
    return statistics.median(runs)


def image_timings(arr: NDArray[Any], spec: qs.ImageSpec, n: int) -> list[tuple[str, float]]:
    img = qs.widen_float16(arr) if arr.dtype == np.float16 else arr
    mins, maxs = qv.extrema(img, spec, 3)
    plane = qs.luminance(img, spec)
    d = differences(plane)
    lv = levels(plane)
    traced = trace(plane)
    assert traced is not None
    timings: list[tuple[str, Callable[[], object]]] = [
        ("float16 -> float32 (FP16 only)", lambda: qs.widen_float16(arr)),
        ("extrema (min/max per channel)", lambda: qv.extrema(img, spec, 3)),
        ("finite (NaN/Inf, given extrema)", lambda: qv.finite(img, mins, maxs)),
        ("range (given extrema)", lambda: qv.value_range(img, spec, mins, maxs)),
        ("luminance plane", lambda: qs.luminance(img, spec)),
        ("differences and their energies (shared)", lambda: differences(plane)),
        ("constant (given the mean)", lambda: qs.constant(plane, lv.mean)),
        ("sharpness (given differences)", lambda: qs.sharpness(plane, d)),
        ("blockiness (given differences)", lambda: qs.blockiness(plane, d)),
        ("levels (counted once for exposure and tone)", lambda: levels(plane)),
        ("exposure (given levels)", lambda: qs.exposure(plane, lv)),
        ("  for exposure: clipped colour channels", lambda: qs.channel_clipped(img, spec)),
        ("  of exposure: graphic test (a candidate over-exposure only)",
         lambda: scenes.graphic(plane, 0.0)),
        ("noise (given differences)", lambda: qs.noise(plane, d)),
        ("  of sharpness: sharpest region (4x4 tiles)", lambda: qs.sharpest_region(d)),
        ("perspective (margin edges)", lambda: scenes.perspective(plane)),
        ("tone (key, given levels)", lambda: scenes.tone(plane, lv)),
        ("shake (given the noise sigma)", lambda: scenes.shake(plane, 0.004)),
        ("washout (key below white, 1/16 grid; opt-in)",
         lambda: washout(plane)),
        ("ghosting (256^2 FFT pair, log; only when a rule names it)",
         lambda: scenes.ghosting(plane)),
        ("moire (224^2 real FFT and nine 128^2 regions; only when a rule names it)",
         lambda: scenes.moire(plane)),
        ("residue: the image's trace (signs, regions; when a rule names it)",
         lambda: trace(plane)),
        ("residue: one pair of traces compared (per earlier image, up to 4)",
         lambda: overlap(traced, traced)),
        ("ALL image signals (image_signals)", lambda: qs.image_signals(arr, spec)),
        ("ALL + ghosting", lambda: qs.image_signals(arr, spec, ("ghosting",))),
        ("ALL + moire", lambda: qs.image_signals(arr, spec, ("moire",))),
        ("ALL + washout", lambda: qs.image_signals(arr, spec, ("washout",))),
    ]
    return [(label, per_call_us(fn, n) if arr.dtype == np.float16 or "FP16" not in label
             else 0.0) for label, fn in timings]


def image_rows(n: int) -> list[tuple[str, list[float]]]:
    hwc = picture()
    chw = np.ascontiguousarray((hwc.transpose(2, 0, 1) / 255.0), np.float32)
    cases: list[tuple[NDArray[Any], qs.ImageSpec]] = [
        (chw, qs.ImageSpec("CHW", (0.0,), (1.0,))),
        (chw.astype(np.float16), qs.ImageSpec("CHW", (0.0,), (1.0,))),
        (hwc, qs.ImageSpec("HWC", (0.0,), (255.0,)))]
    rows: dict[str, list[float]] = {}
    for arr, spec in cases:
        for label, us in image_timings(arr, spec, n):
            rows.setdefault(label, []).append(us)
    return list(rows.items())


def text_rows(n: int) -> list[tuple[str, float]]:
    cls, script = qt._classify(TEXT_1KB)
    return [
        ("classify code points (table lookup)", per_call_us(lambda: qt._classify(TEXT_1KB), n)),
        ("counts: empty/length/control/replacement/symbols",
         per_call_us(lambda: np.bincount(cls, minlength=6), n)),
        ("repetition (token runs, periods 1-3)", per_call_us(
            lambda: qt.repeated_run(TEXT_1KB), n)),
        ("script (mixed-script words)", per_call_us(
            lambda: qt.mixed_script_share(cls, script), n)),
        ("ALL text signals (text_signals)", per_call_us(lambda: qt.text_signals(TEXT_1KB), n)),
    ]


RESIDUE_RULE = next(r for r in SCREEN_RULES if r.signal == "residue")


def filter_rows(n: int) -> list[tuple[str, float]]:
    async def ok(call: Call) -> Reply:
        return Result(call.model)

    def make(cfg: dict[str, Any]) -> Quality:
        ctx = FilterContext("bench", Telemetry(), SystemClock(), random.Random(0), lambda: None)
        return Quality(QualityConfig.model_validate(cfg), ctx)

    hwc = picture()
    px = np.ascontiguousarray((hwc.transpose(2, 0, 1) / 255.0)[None], np.float32)
    buf = io.BytesIO()
    from PIL import Image
    Image.fromarray(hwc).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    text = encode_bytes_elements([TEXT_1KB.encode()])
    doc = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is in this picture?"},
        {"type": "image_url", "image_url": {"url": url}}]}]}

    def v2_image() -> Call:
        return Call("m", "", [Tensor.from_numpy("pixel_values", px)], target=Target("b", "m"))

    pair = np.ascontiguousarray(np.concatenate([px, px[:, :, ::-1]]))

    def v2_pair() -> Call:
        return Call("m", "", [Tensor.from_numpy("pixel_values", pair)], target=Target("b", "m"))

    def v2_text() -> Call:
        return Call("m", "", [Tensor("text", "BYTES", (1,), raw=text)], target=Target("b", "m"))

    def chat() -> Call:
        return Call("m", "", [], document=doc, endpoint="/v1/chat/completions",
                    target=Target("b", "m"))

    images: dict[str, Any] = {"images": {"pixel_values": {}}}
    cases: list[tuple[str, dict[str, Any], Callable[[], Call]]] = [
        ("v2 FP32 [1,3,224,224], drift off", {**images, "drift": None}, v2_image),
        ("v2 FP32 [1,3,224,224], drift on", images, v2_image),
        ("v2 FP32 [2,3,224,224], drift off", {**images, "drift": None}, v2_pair),
        ("v2 FP32 [2,3,224,224], drift off, + a residue rule",
         {**images, "drift": None, "rules": [*DEFAULT_RULES, RESIDUE_RULE]}, v2_pair),
        ("v2 BYTES 1 KB text, drift on", {"texts": {"text": {}}}, v2_text),
        ("OpenAI chat, 224 PNG + text (decode, thread)", {}, chat)]
    loop = asyncio.new_event_loop()

    def one_request(f: Quality, make_call: Callable[[], Call]) -> Callable[[], object]:
        return lambda: loop.run_until_complete(f(make_call(), ok))

    try:
        return [(label, per_call_us(one_request(make(cfg), make_call), max(n // 4, 20)))
                for label, cfg, make_call in cases]
    finally:
        loop.close()


def through_mmguard(tmp: Path, n: int) -> tuple[float, float]:
    models = ort_repository(tmp / "models")
    cfg = {"backends": [{"kind": "onnxruntime", "name": "ort", "model_dir": str(models)}],
           "models": [{"name": "plain", "backend": "ort", "backend_model": "clip_demo"},
                      {"name": "scored", "backend": "ort", "backend_model": "clip_demo",
                       "filters": [{"quality": {"images": {"pixel_values": {}}}}]}]}
    px = np.ascontiguousarray((picture().transpose(2, 0, 1) / 255.0)[None], np.float32)
    ids = np.ones((1, 77), np.int64)
    tensors = [("pixel_values", "FP32", [1, 3, 224, 224], px.tobytes()),
               ("input_ids", "INT64", [1, 77], ids.tobytes())]
    reqs = {r: grpc_request(r, tensors) for r in ("plain", "scored")}
    times: dict[str, list[float]] = {"plain": [], "scored": []}
    with RunningMmguard(cfg) as m:
        m.wait_ready()
        for i in range(max(60, n // 4)):
            for route, req in reqs.items():  # interleaved, so machine noise hits both alike
                t0 = time.perf_counter()
                grpc_infer_raw(m.grpc_url, req)
                if i >= 10:
                    times[route].append(time.perf_counter() - t0)
    return statistics.median(times["plain"]) * 1e3, statistics.median(times["scored"]) * 1e3


def signals_of(root: Path) -> Any:
    """``filters.quality.signals`` of the checkout at ``root``, imported beside this one's (the
    modules of this checkout are put back afterwards; the other's keep their own references)."""
    mine = {k: sys.modules.pop(k) for k in list(sys.modules)
            if k == "filters" or k.startswith("filters.")}
    sys.path.insert(0, str(root))
    try:
        import filters.quality.signals as other
    finally:
        sys.path.remove(str(root))
        for k in [k for k in sys.modules if k == "filters" or k.startswith("filters.")]:
            sys.modules[f"against.{k}"] = sys.modules.pop(k)
        sys.modules.update(mine)
    return other


def against(root: Path, n: int, rounds: int, optional: tuple[str, ...] = ()) -> None:
    other = signals_of(root)
    hwc = picture()
    chw = np.ascontiguousarray((hwc.transpose(2, 0, 1) / 255.0), np.float32)
    inputs = [("FP32 NCHW", chw, "CHW", 1.0), ("FP16 NCHW", chw.astype(np.float16), "CHW", 1.0),
              ("UINT8 HWC", hwc, "HWC", 255.0)]
    runs: dict[tuple[str, str], list[float]] = {}
    process, thread = time.process_time(), time.thread_time()
    for _ in range(rounds):
        for label, arr, layout, high in inputs:
            for side, mod in (("before", other), ("after", qs)):
                spec = mod.ImageSpec(layout, (0.0,), (high,))
                mod.image_signals(arr, spec, optional)
                start = time.process_time()
                for _ in range(n):
                    mod.image_signals(arr, spec, optional)
                runs.setdefault((label, side), []).append(
                    (time.process_time() - start) / n * 1e6)
    spin = (time.process_time() - process) / (time.thread_time() - thread)
    extra = f", with {', '.join(optional)}" if optional else ""
    print(f"image_signals{extra}, µs of CPU per call, {rounds} alternated rounds of {n}: "
          "median (range)")
    print(f"{'input':10} {'before':>20} {'after':>20} {'after/before':>13}")
    for label, *_ in inputs:
        b, a = runs[(label, "before")], runs[(label, "after")]
        mb, ma = statistics.median(b), statistics.median(a)
        print(f"{label:10} {mb:8.0f} ({min(b):4.0f}-{max(b):4.0f}) {ma:8.0f} ({min(a):4.0f}-"
              f"{max(a):4.0f}) {ma / mb:13.2f}")
    print(f"process / thread CPU over the run: {spin:.3f}")


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.quality",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=400, help="calls per timing run")
    ap.add_argument("--cpu", type=int, default=None, help="the CPU to pin to (default: first)")
    ap.add_argument("--no-server", action="store_true", help="skip part 3")
    ap.add_argument("--against", type=Path, default=None, metavar="DIR",
                    help="compare image_signals with the checkout at DIR, alternated, and exit")
    ap.add_argument("--rounds", type=int, default=9, help="alternated rounds for --against")
    ap.add_argument("--optional", default="", metavar="NAME[,NAME]",
                    help="--against: also the opt-in signals named (moire, ghosting, washout)")
    args = ap.parse_args()
    cpus = os.sched_getaffinity(0)
    cpu = args.cpu if args.cpu is not None else min(cpus)
    os.sched_setaffinity(0, {cpu})
    if args.against is not None:
        optional = tuple(filter(None, args.optional.split(",")))
        per_image = scenes.OPTIONAL_SIGNALS - set(qs.REQUEST_SIGNALS)  # residue reads pairs
        unknown = set(optional) - per_image
        if unknown:
            ap.error(f"--optional: unknown signal(s) {sorted(unknown)}; known: "
                     f"{', '.join(sorted(per_image))}")
        against(args.against, max(args.n // 4, 20), args.rounds, optional)
        return 0
    qt.char_tables()
    print(f"quality signals, one core (CPU {cpu}), median µs per call\n")
    print(f"{'image signal, 224x224':44} {'FP32 NCHW':>10} {'FP16 NCHW':>10} {'UINT8 HWC':>10}")
    for label, us in image_rows(args.n):
        print(f"{label:44} {us[0]:10.1f} {us[1]:10.1f} {us[2]:10.1f}")
    print(f"\n{'text signal, 1 KB':52} {'µs':>10}")
    for label, us1 in text_rows(args.n):
        print(f"{label:52} {us1:10.1f}")
    print(f"\n{'whole filter, in-process, per request':52} {'µs':>10}")
    for label, us1 in filter_rows(args.n):
        print(f"{label:52} {us1:10.1f}")
    if not args.no_server:
        os.sched_setaffinity(0, cpus)  # the server, its ORT pool and the client: all cores
        with tempfile.TemporaryDirectory() as d:
            plain, scored = through_mmguard(Path(d), args.n)
        print("\nthrough mmguard (gRPC -> ORT clip_demo, FP32 [1,3,224,224]), median, c=1")
        print(f"{'no filter ms':>14} {'quality ms':>12} {'added µs':>10}")
        print(f"{plain:14.3f} {scored:12.3f} {(scored - plain) * 1e3:10.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
