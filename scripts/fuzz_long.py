"""The long fuzz run: the properties of ``tests/fuzz`` for a given time, with many examples.

Each decoder (``tests/fuzz/properties.py``) and, unless ``--no-fronts``, each front of a running
mmguard (``tests/fuzz/fronts.py``) gets an equal share of the time, in hypothesis batches of
``--batch`` examples. Prints the count of inputs tried per target (shrinking included) as it goes
and at the end. Every distinct failure (exception type and the line that raised it) is saved,
with its shrunk reproducing input, under ``--out``; the exit code is 1 when there was any.

    python scripts/fuzz_long.py --minutes 3
    python scripts/fuzz_long.py --minutes 30 --only http_v2,openai --no-fronts
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hypothesis import Verbosity, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.fuzz.profiles import FUZZ_LONG  # noqa: E402


@dataclass
class Failure:
    input: Any
    """The shrunk reproducing input."""
    traceback: str
    hits: int = 1
    """Inputs that failed the same way (counted, not shrunk again, once the failure is known)."""


@dataclass
class Target:
    name: str
    inputs: st.SearchStrategy[Any]
    check: Callable[[Any], None]
    over_sockets: bool = False
    """Then the client's timeout is the hang guard, not hypothesis' deadline (see profiles.py)."""
    tried: int = 0
    seconds: float = 0.0
    failures: dict[str, Failure] = field(default_factory=dict)
    """Keyed by where it failed: "TypeError at proxy/wire/kserve_http.py:83"."""


def origin(exc: BaseException) -> str:
    """The exception type and the deepest frame of mmguard's own code that raised it (else the
    deepest frame of this repository: the property's assertion, then with its message, numbers
    and quoted names blanked, so that two wrong statuses are two failures, not one)."""
    own = mine = "?"
    for frame in traceback.extract_tb(exc.__traceback__):
        path = Path(frame.filename)
        if not path.is_relative_to(ROOT) or {".venv", "site-packages"} & set(path.parts):
            continue
        rel = path.relative_to(ROOT)
        mine = f"{rel}:{frame.lineno}"
        if rel.parts[0] in ("proxy", "filters"):
            own = mine
    where = f"{type(exc).__name__} at {own if own != '?' else mine}"
    if isinstance(exc, AssertionError) and own == "?":
        where += ": " + _shape_of((str(exc).splitlines() or [""])[0])
    return where


def _shape_of(message: str) -> str:
    """A message with what varies from input to input blanked: quoted text, bracketed lists,
    numbers ("HTTP 500: Required inputs ([…]) are missing from input feed ([…])")."""
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "…", message)
    while (inner_first := re.sub(r"\[[^\[\]]*\]", "\x00", text)) != text:  # nested lists
        text = inner_first
    return re.sub(r"\d+", "…", text).replace("\x00", "[…]")[:80]


def run_batch(target: Target, examples: int) -> None:
    """One hypothesis run. A failure already known is counted and let pass, so the search goes
    on past it (a frequent bug would otherwise end every batch and hide the rarer ones)."""
    seen: dict[str, Failure] = {}

    @settings(FUZZ_LONG, max_examples=examples, verbosity=Verbosity.quiet,
              deadline=None if target.over_sockets else FUZZ_LONG.deadline)
    @given(target.inputs)
    def prop(x: Any) -> None:
        target.tried += 1
        try:
            target.check(x)
        except Exception as exc:
            where = origin(exc)
            if where in target.failures:
                target.failures[where].hits += 1
                return
            # Hypothesis replays the shrunk example last, so the last one kept is the smallest.
            seen[where] = Failure(x, "".join(traceback.format_exception(exc)))
            raise

    start = time.monotonic()
    try:
        prop()
    except Exception:  # the failures are in ``seen``; a batch with failures ends early
        pass
    finally:
        target.seconds += time.monotonic() - start
    for where, found in seen.items():
        print(f"  new failure in {target.name}: {where}", flush=True)
        target.failures[where] = found


def _payload(x: Any) -> bytes | None:
    """The request body in a drawn input, to replay with curl or grpcurl."""
    if isinstance(x, bytes):
        return x
    if isinstance(x, tuple):
        return next((p for p in x if isinstance(p, bytes)), None)
    return None


def save_failures(targets: list[Target], out: Path) -> int:
    count = 0
    for t in targets:
        for i, (where, f) in enumerate(sorted(t.failures.items())):
            stem = out / f"{t.name}-{i}"
            stem.with_suffix(".txt").write_text(
                f"target: {t.name}\nfailure: {where}\ninputs that failed this way: {f.hits}\n\n"
                f"input:\n{f.input!r}\n\n{f.traceback}")
            payload = _payload(f.input)
            if payload is not None:
                stem.with_suffix(".bin").write_bytes(payload)
            count += 1
    return count


def table(targets: list[Target]) -> str:
    lines = [f"{'target':<16} {'inputs tried':>12} {'inputs/s':>9} {'seconds':>8} "
             f"{'failures':>8}"]
    for t in targets:
        rate = t.tried / t.seconds if t.seconds else 0.0
        lines.append(f"{t.name:<16} {t.tried:>12,} {rate:>9.0f} {t.seconds:>8.0f} "
                     f"{len(t.failures):>8}")
    total = sum(t.tried for t in targets)
    lines.append(f"{'total':<16} {total:>12,}")
    return "\n".join(lines)


def _bound(check: Callable[[Any, Any], None], client: Any) -> Callable[[Any], None]:
    return lambda x: check(client, x)


@contextlib.contextmanager
def front_targets(only: set[str] | None) -> Iterator[list[Target]]:
    """The fronts' targets, against one mmguard on ONNX Runtime for the whole run."""
    from tests.conftest import ort_config
    from tests.fuzz.fronts import FRONTS, Client, check_still_serving
    from tests.support.mmguard import RunningMmguard
    from tests.support.models import ort_repository

    chosen = [f for f in FRONTS.values() if only is None or f.name in only]
    if not chosen:
        yield []
        return
    # mmguard runs in this process: its log (a traceback per 500) goes to a file, not the screen.
    log_path = Path(tempfile.gettempdir()) / "fuzz_long-mmguard.log"
    handler = logging.FileHandler(log_path, mode="w")
    for name in ("mmguard", "aiohttp", "grpc"):
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.propagate = False
    print(f"mmguard's log: {log_path}")
    with tempfile.TemporaryDirectory(prefix="fuzz-ort-") as tmp, \
            RunningMmguard(ort_config(ort_repository(Path(tmp)))) as proxy:
        proxy.wait_ready()
        client = Client(proxy)
        try:
            yield [Target(f.name, f.inputs(), _bound(f.check, client), over_sockets=True)
                   for f in chosen]
            check_still_serving(client)
            print("after the run, mmguard still answers a valid request correctly")
        finally:
            client.close()


def fuzz(targets: list[Target], minutes: float, batch: int) -> None:
    end = time.monotonic() + minutes * 60
    last_report = time.monotonic()
    while time.monotonic() < end:
        target = min(targets, key=lambda t: t.seconds)  # equal time for each target
        run_batch(target, batch)
        if time.monotonic() - last_report > 30:
            last_report = time.monotonic()
            print("  " + ", ".join(f"{t.name} {t.tried:,}" for t in targets), flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="total run time (10)")
    p.add_argument("--batch", type=int, default=500,
                   help="examples per hypothesis batch; the time is checked between batches")
    p.add_argument("--only", default="", help="comma-separated target names (default: all)")
    p.add_argument("--no-fronts", action="store_true",
                   help="decoders only: do not start mmguard and fuzz its fronts over sockets")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "fuzz",
                   help="folder for the reproducing inputs of failures")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from tests.fuzz.properties import DECODERS

    only = {n.strip() for n in args.only.split(",") if n.strip()} or None
    targets = [Target(d.name, d.inputs(), d.check) for d in DECODERS.values()
               if only is None or d.name in only]
    fronts_cm: contextlib.AbstractContextManager[list[Target]] = (
        contextlib.nullcontext([]) if args.no_fronts else front_targets(only))
    with fronts_cm as fronts:
        targets += fronts
        if not targets:
            print("no targets chosen", file=sys.stderr)
            return 2
        print(f"fuzzing {', '.join(t.name for t in targets)} for {args.minutes:g} min",
              flush=True)
        fuzz(targets, args.minutes, args.batch)
    print(table(targets))
    if any(t.failures for t in targets):
        args.out.mkdir(parents=True, exist_ok=True)
        n = save_failures(targets, args.out)
        print(f"{n} distinct failure(s); reproducing inputs in {args.out}", file=sys.stderr)
        for t in targets:
            for where, f in sorted(t.failures.items()):
                print(f"  {t.name}: {where} ({f.hits} inputs)", file=sys.stderr)
        return 1
    print("no failures")
    return 0


if __name__ == "__main__":
    sys.exit(main())
