"""``mmguard status``: a running mmguard's live state, read from its admin API, in the terminal.

Reads ``/readyz``, ``/admin`` (every installed filter's table: breakers, router weights, fault
experiments, canary verdicts, and any other filter's), ``/admin/pod`` and ``/metrics`` (standard
library HTTP only) and prints readiness, request counts per route by outcome code and the
filters' tables. Exit 0 when the admin API answered, 1 (naming the URL) when it did not.
In a pod: ``kubectl exec deploy/mmguard-clip -c mmguard -- mmguard status``.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, TextIO

from prometheus_client.parser import text_string_to_metric_families

DEFAULT_ADMIN = "http://127.0.0.1:9002"


class Unreachable(Exception):
    """The admin API did not answer (connection refused, timeout, not HTTP, unexpected status)."""


@dataclass
class Status:
    admin: str
    ready: bool
    requests: dict[str, dict[str, float]] = field(default_factory=dict)
    """route → outcome code → count (summed over fronts and backends)."""
    backends: dict[str, bool] = field(default_factory=dict)
    routes: dict[str, bool] = field(default_factory=dict)
    """route → ready (its backend ready and its contract known), from the metrics."""
    why: dict[str, str] = field(default_factory=dict)
    """``backend <name>`` / ``route <name>`` → why it is not ready (``/readyz``, one process)."""
    tables: list[dict[str, Any]] = field(default_factory=list)
    """Each filter's ``Summary`` (``GET /admin``), in their order."""
    workers: list[dict[str, Any]] = field(default_factory=list)
    """The pod's worker processes (one, the process itself, outside a pod)."""


def _get(url: str, timeout: float, ok_statuses: tuple[int, ...] = (200,)) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status), bytes(r.read())
    except urllib.error.HTTPError as e:
        if e.code in ok_statuses:
            return e.code, bytes(e.read())
        raise Unreachable(f"{url} answered HTTP {e.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise Unreachable(f"cannot reach {url}: {reason}") from None


def _json(url: str, timeout: float, ok_statuses: tuple[int, ...] = (200,)) -> Any:
    _, body = _get(url, timeout, ok_statuses)
    try:
        return json.loads(body)
    except ValueError:
        raise Unreachable(f"{url} did not answer JSON: is this mmguard's admin port?") from None


def fetch(admin: str, timeout: float = 5.0) -> Status:
    base = admin.rstrip("/")
    if "://" not in base:
        base = "http://" + base
    ready_doc = _json(f"{base}/readyz", timeout, ok_statuses=(200, 503))
    status = Status(admin=base, ready=bool(ready_doc.get("ready")))
    for kind in ("backends", "routes"):
        for name, doc in (ready_doc.get(kind) or {}).items():
            if isinstance(doc, dict) and doc.get("why"):
                status.why[f"{kind[:-1]} {name}"] = str(doc["why"])
    index = _json(f"{base}/admin", timeout)
    found = [f["summary"] for f in (index.get("filters") or {}).values() if f.get("summary")]
    status.tables = sorted(found, key=lambda t: (t.get("order", 100), t.get("title", "")))
    code, _ = _get(f"{base}/admin/pod", timeout, ok_statuses=(200, 404))
    if code == 200:  # 404: an mmguard from before pods
        status.workers = list(_json(f"{base}/admin/pod", timeout).get("workers", []))
    _, metrics = _get(f"{base}/metrics", timeout)
    requests: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    try:
        families = list(text_string_to_metric_families(metrics.decode()))
    except (ValueError, UnicodeDecodeError) as e:
        raise Unreachable(f"{base}/metrics is not Prometheus text: {e}") from None
    for family in families:
        for sample in family.samples:
            if sample.name == "mmguard_requests_total":
                requests[sample.labels["model"]][sample.labels["code"]] += sample.value
            elif sample.name == "mmguard_backend_ready":
                status.backends[sample.labels["backend"]] = sample.value == 1
            elif sample.name == "mmguard_route_ready":
                status.routes[sample.labels["model"]] = sample.value == 1
    status.requests = {route: dict(codes) for route, codes in sorted(requests.items())}
    return status


def _table(rows: list[list[str]], out: TextIO, indent: str = "  ") -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        out.write(indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True))
                  .rstrip() + "\n")


def _render_workers(workers: list[dict[str, Any]], out: TextIO) -> None:
    out.write(f"workers: {len(workers)} (one control state for the pod)\n")
    rows = [["worker", "pid", "ready", "restarts", "last exits"]]
    for w in workers:
        rows.append([str(w.get("worker")), str(w.get("pid")),
                     "yes" if w.get("ready") else "NO", str(w.get("restarts", 0)),
                     ", ".join(map(str, w.get("exit_codes") or [])) or "-"])
    _table(rows, out)


def render(s: Status, out: TextIO) -> None:
    out.write(f"mmguard at {s.admin}: {'READY' if s.ready else 'NOT READY'}\n")
    for kind, states in (("backend", s.backends), ("route", s.routes)):
        if states:
            out.write(f"{kind}s: " + ", ".join(f"{b} {'ready' if ok else 'NOT READY'}"
                                               for b, ok in sorted(states.items())) + "\n")
        for name, ok in sorted(states.items()):
            why = s.why.get(f"{kind} {name}")
            if not ok:
                out.write(f"  {kind} {name}: {why or 'not ready (see its log)'}\n")
    if len(s.workers) > 1:
        _render_workers(s.workers, out)

    out.write("\nrequests (since start)\n")
    if s.requests:
        codes = sorted({c for by_code in s.requests.values() for c in by_code},
                       key=lambda c: (c != "ok", c))
        rows = [["route", "total", *codes]]
        for route, by_code in s.requests.items():
            rows.append([route, f"{sum(by_code.values()):.0f}",
                         *(f"{by_code.get(c, 0):.0f}" for c in codes)])
        _table(rows, out)
    else:
        out.write("  none yet\n")

    for t in s.tables:
        out.write(f"\n{t.get('title')}\n")
        if t.get("rows"):
            _table([list(t.get("columns", [])), *t["rows"]], out)
        else:
            out.write(f"  {t.get('empty') or 'none'}\n")


def main(args: argparse.Namespace) -> int:
    admin: str = args.admin
    try:
        status = fetch(admin, timeout=args.timeout)
    except Unreachable as e:
        print(f"mmguard status: cannot read the admin API at {admin}: {e}", file=sys.stderr)
        return 1
    render(status, sys.stdout)
    return 0
