"""``mmguard status``: a running mmguard's live state, read from its admin API, in the terminal.

Reads ``/readyz``, ``/admin/breakers``, ``/admin/routers``, ``/admin/experiments``,
``/admin/shadows`` and ``/metrics`` (standard library HTTP only) and prints readiness, request
counts per route by outcome code, breaker states, router weights, fault experiments and canary
verdicts. Exit 0 when the admin API answered, 1 (naming the URL) when it did not.
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
    breakers: list[dict[str, Any]] = field(default_factory=list)
    routers: dict[str, dict[str, Any]] = field(default_factory=dict)
    experiments: list[dict[str, Any]] = field(default_factory=list)
    shadows: dict[str, dict[str, Any]] = field(default_factory=dict)
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
    status.breakers = list(_json(f"{base}/admin/breakers", timeout))
    status.routers = dict(_json(f"{base}/admin/routers", timeout))
    status.experiments = list(_json(f"{base}/admin/experiments", timeout))
    status.shadows = dict(_json(f"{base}/admin/shadows", timeout))
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
    if s.backends:
        out.write("backends: " + ", ".join(f"{b} {'ready' if ok else 'NOT READY'}"
                                           for b, ok in sorted(s.backends.items())) + "\n")
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

    out.write("\nbreakers\n")
    if s.breakers:
        rows = [["route", "level", "state", "calls", "failure rate", "slow rate", "reason"]]
        for b in s.breakers:
            rows.append([str(b.get("route", "")), str(b.get("level", "")),
                         str(b.get("state", "")).upper(), str(b.get("calls_in_window", "")),
                         f"{b.get('failure_rate', 0):.0%}", f"{b.get('slow_call_rate', 0):.0%}",
                         str(b.get("reason") or "")])
        _table(rows, out)
    else:
        out.write("  none (no route uses the fallback filter)\n")

    out.write("\nrouters\n")
    if s.routers:
        rows = [["route", "path", "weight", "latency ewma", "error rate", "confidence"]]
        for route, snap in s.routers.items():
            weights: dict[str, float] = snap.get("weights", {})
            paths: dict[str, dict[str, Any]] = snap.get("paths", {})
            for path, weight in weights.items():
                p = paths.get(path, {})
                lat = p.get("latency_ewma_ms")
                conf = p.get("confidence")
                rows.append([route, path, f"{weight:.3f}",
                             "-" if lat is None else f"{lat:.1f} ms",
                             f"{p.get('error_rate', 0):.0%}",
                             "-" if conf is None else f"{conf:.3f}"])
        _table(rows, out)
    else:
        out.write("  none (no route uses modality_router)\n")

    out.write("\nfault experiments\n")
    if s.experiments:
        rows = [["name", "route", "state", "matched", "injected", "window errors", "why stopped"]]
        for e in s.experiments:
            w = e.get("window") or {}
            rate = w.get("error_rate")
            rows.append([str(e.get("name")), str(e.get("route")), str(e.get("state")).upper(),
                         str(e.get("matched", 0)),
                         ", ".join(f"{k} {v}" for k, v in (e.get("injected") or {}).items())
                         or "0", "-" if rate is None else f"{rate:.1%}",
                         str(e.get("stop_reason") or "")])
        _table(rows, out)
    else:
        out.write("  none\n")

    out.write("\ncanary verdicts\n")
    if s.shadows:
        rows = [["route", "canary", "verdict", "compared", "agreement", "mirroring", "reasons"]]
        for route, snap in s.shadows.items():
            agreement = snap.get("effective_agreement")
            rows.append([route, str(snap.get("canary")), str(snap.get("state")).upper(),
                         str(snap.get("compared", 0)),
                         "-" if agreement is None else f"{agreement:.1%}",
                         "yes" if snap.get("mirroring") else "stopped",
                         "; ".join(snap.get("reasons") or [])[:120]])
        _table(rows, out)
    else:
        out.write("  none (no route uses the shadow filter)\n")


def main(args: argparse.Namespace) -> int:
    admin: str = args.admin
    try:
        status = fetch(admin, timeout=args.timeout)
    except Unreachable as e:
        print(f"mmguard status: cannot read the admin API at {admin}: {e}", file=sys.stderr)
        return 1
    render(status, sys.stdout)
    return 0
