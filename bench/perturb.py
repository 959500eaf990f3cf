"""What each seeded perturbation (filters/perturb.py) costs on one core: a [1,3,224,224] float32
image, [1,77] int64 token ids and a 1 KB text, plus FGSM and PGD (5 steps) through a small
TorchScript surrogate when torch is installed.

    python -m bench.perturb [--runs 200] [--cpu 0] [--md]

The process pins itself to one CPU and sets BLAS and torch to one thread before they load, so a
millisecond is a millisecond of one core. Each row: ``--runs`` timed calls after 3 untimed ones,
median and p90 in ms. Every call gets a fresh seeded generator, as the fault filter does per
request (its creation is part of the cost).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# One core means one BLAS/OpenMP thread too: set before numpy (and torch) are imported.
for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")

import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable  # noqa: E402

import numpy as np  # noqa: E402
from numpy.typing import NDArray  # noqa: E402

from bench.common import render_table  # noqa: E402
from filters import perturb as pt  # noqa: E402
from tests.support.images import scene  # noqa: E402

TEXT_1KB = ("A small red bicycle leans against a brick wall in the late afternoon sun; a cat "
            "sleeps on the step beside it, and two people talk near the door of the cafe. ")
TEXT_1KB = (TEXT_1KB * (1024 // len(TEXT_1KB) + 1))[:1024]


def timings_ms(fn: Callable[[], object], runs: int) -> tuple[float, float]:
    """(median, p90) of ``runs`` calls in ms, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    lat = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        lat.append((time.perf_counter() - t0) * 1e3)
    lat.sort()
    return statistics.median(lat), lat[min(len(lat) - 1, int(0.9 * len(lat)))]


def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def numpy_cases(x: NDArray[np.float32], ids: NDArray[np.int64],
                ) -> list[tuple[str, Callable[[], object]]]:
    return [
        ("gaussian_noise σ=0.08", lambda: pt.gaussian_noise(x, 0.08, rng())),
        ("sign_noise ε=0.03", lambda: pt.sign_noise(x, 0.03, rng())),
        ("patch_mask 0.25, 16 px", lambda: pt.patch_mask(x, 0.25, 16, rng())),
        ("occlude 20 %", lambda: pt.occlude(x, 0.2, rng())),
        ("precision_collapse round 3", lambda: pt.precision_collapse(x, "round", 3)),
        ("precision_collapse fp16", lambda: pt.precision_collapse(x, "fp16")),
        ("precision_collapse bf16", lambda: pt.precision_collapse(x, "bf16")),
        ("blur radius 1", lambda: pt.blur(x, 1.0)),
        ("blur radius 3", lambda: pt.blur(x, 3.0)),
        ("darken 0.3", lambda: pt.darken(x, 0.3)),
        ("quantise 8 levels", lambda: pt.quantise(x, 8)),
        ("token_dropout p=0.15 [1,77]", lambda: pt.token_dropout(ids, 0.15, rng(), keep_first=1)),
        ("token_mask 0.25 [1,77]", lambda: pt.token_mask(ids, 0.25, rng())),
        ("shared_mask 0.25 (image + [1,77])", lambda: pt.shared_mask(1234, x, ids, 0.25, 16)),
        ("word_dropout p=0.15, 1 KB", lambda: pt.word_dropout(TEXT_1KB, 0.15, rng())),
        ("mixed_scripts 0.3, 1 KB", lambda: pt.mixed_scripts(TEXT_1KB, 0.3, rng())),
        ("cut_text 0.5, 1 KB", lambda: pt.cut_text(TEXT_1KB, 0.5)),
    ]


def torch_cases(x: NDArray[np.float32], tmp: Path) -> list[tuple[str, Callable[[], object]]]:
    """FGSM/PGD through a small conv 'similarity' saved and loaded as TorchScript; [] without
    torch."""
    try:
        import torch
    except ImportError:
        print("torch is not installed: no FGSM/PGD rows (pip install 'mmguard[torch]')")
        return []
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 7, stride=4, padding=3), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 1))
    path = tmp / "surrogate.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TorchScript is the contract
        # torch.jit.trace has no annotations in torch's own stubs
        traced = torch.jit.trace(model.eval(), torch.from_numpy(x))  # type: ignore[no-untyped-call]
        traced.save(str(path))
    loss = pt.load_surrogate(str(path))
    return [
        ("fgsm ε=0.03 (1 gradient)", lambda: pt.fgsm(x, 0.03, loss)),
        ("pgd ε=0.03, 5 steps", lambda: pt.fgsm(x, 0.03, loss, steps=5)),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.perturb",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=200, help="timed calls per row")
    ap.add_argument("--cpu", type=int, default=None, help="the CPU to pin to (default: first)")
    ap.add_argument("--md", action="store_true", help="print a Markdown table")
    args = ap.parse_args()
    cpu = args.cpu if args.cpu is not None else min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    x = np.ascontiguousarray((scene(224, 0) / 255.0).transpose(2, 0, 1)[None], np.float32)
    ids = np.random.default_rng(0).integers(1, 49000, (1, 77), dtype=np.int64)
    ids[0, 0], ids[0, 20:] = 49406, 0  # BOS, 19 tokens, padding: a CLIP-like prompt
    with tempfile.TemporaryDirectory() as d:
        cases = numpy_cases(x, ids) + torch_cases(x, Path(d))
        body = []
        for label, fn in cases:
            median, p90 = timings_ms(fn, args.runs)
            body.append([label, f"{median:.4f}", f"{p90:.4f}"])
    print(f"perturbations, one core (CPU {cpu}), {args.runs} runs each; image FP32 [1,3,224,224]\n")
    print(render_table(["perturbation", "median ms", "p90 ms"], body, args.md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
