"""``mmguard canary-report``: the canary verdicts of a running mmguard, as a table or an HTML page.

Reads ``GET /admin/shadows`` (route → ``{"canary": route, **Verdict.snapshot()}``) with the
standard library, prints one row per shadowed route (or the raw JSON with ``--json``) — the
correctness figures (clean copies only, with how many faulted copies were left out), latency,
and, for a robustness experiment, production vs canary per perturbation with 95 % intervals —
and, with ``--html FILE``, writes a self-contained page: summary tables, the robustness plot a
release reviewer looks at first (each side's share of clean answers kept, per perturbation, with
its interval), and hand-written SVG histograms of each comparison metric and of primary vs
canary latency (no scripts, nothing fetched).
Exit codes, for a CI gate or a rollout script:

- 0: every route is ``collecting``, ``hold`` or ``promote``;
- 3: at least one route is ``abort``;
- 2: the admin API could not be read (the message names the URL).
"""

from __future__ import annotations

import argparse
import json
import sys
from html import escape
from pathlib import Path
from typing import Any

from proxy.cli.status import Unreachable, _json

EXIT_OK, EXIT_UNREACHABLE, EXIT_ABORT = 0, 2, 3
_COLOURS = {"primary": "#4477aa", "canary": "#ee6677"}
_STATE_COLOURS = {"promote": "#228833", "hold": "#ccbb44", "abort": "#ee6677",
                  "collecting": "#bbbbbb"}


def fetch_shadows(admin: str, timeout: float = 5.0) -> dict[str, dict[str, Any]]:
    base = admin.rstrip("/")
    if "://" not in base:
        base = "http://" + base
    doc = _json(f"{base}/admin/shadows", timeout)
    if not isinstance(doc, dict) or not all(isinstance(v, dict) for v in doc.values()):
        raise Unreachable(f"{base}/admin/shadows did not answer a route → snapshot object")
    return doc


def _pct(x: Any) -> str:
    return f"{x:.1%}" if isinstance(x, int | float) else "-"


def _ms(x: Any) -> str:
    return f"{x:.1f} ms" if isinstance(x, int | float) else "-"


def _p99(snap: dict[str, Any], side: str) -> Any:
    return (snap.get("latency_ms") or {}).get(side, {}).get("p99")


def _summary(route: str, snap: dict[str, Any]) -> list[str]:
    reasons = [str(r) for r in snap.get("reasons") or []]
    shown = "; ".join(reasons[:2]) + (f" (+{len(reasons) - 2} more)" if len(reasons) > 2 else "")
    return [route, str(snap.get("canary", "-")), str(snap.get("state", "?")).upper(),
            str(snap.get("samples", 0)), _pct(snap.get("agreement")),
            _pct(snap.get("effective_agreement")), _ms(_p99(snap, "primary")),
            _ms(_p99(snap, "canary")), shown]


def render_table(shadows: dict[str, dict[str, Any]]) -> str:
    """One fixed-width row per route; the reasons column, last, is not padded."""
    if not shadows:
        return "no shadowed routes (no route uses the shadow filter)\n"
    rows = [["route", "canary", "state", "samples", "agreement", "effective", "p99 primary",
             "p99 canary", "reasons"]]
    rows += [_summary(route, snap) for route, snap in sorted(shadows.items())]
    out = _fixed(rows)
    for route, snap in sorted(shadows.items()):
        out += evidence_text(route, snap)
        if "excluded" in snap:
            out += (f"\n{route}: correctness on {snap.get('samples', 0)} clean copies; "
                    f"{snap['excluded']} copies a fault touched left out\n")
        table = robustness_rows(snap)
        if len(table) > 1:
            out += f"robustness of {route} vs {snap.get('canary', '-')}:\n" + _fixed(table)
    return out


def evidence_text(route: str, snap: dict[str, Any]) -> str:
    """Each figure the verdict decides on, with its anytime bounds, its test and error rate,
    and what a decision still needs."""
    ev = snap.get("evidence")
    if not isinstance(ev, dict):
        return ""
    state = str(snap.get("state", "?")).upper()
    decided = snap.get("decided") or {}
    at = f" at {decided.get('comparisons')} comparisons" if decided else ""
    out = [f"\nverdict of {route} vs {snap.get('canary', '-')}: {state}{at}; "
           f"alpha {ev.get('alpha')} (false abort, split over {ev.get('abort_tests')} abort "
           f"tests), beta {ev.get('beta')} (false promote); {ev.get('method')}"]
    a = ev.get("agreement") or {}
    if a:
        out.append(f"  agreement  {_pct(a.get('estimate'))} of {a.get('samples', 0)}, bounds "
                   f"[{_pct(a.get('lower'))}, {_pct(a.get('upper'))}]: promote when the lower "
                   f"≥ {_pct(a.get('promote_at'))} (beta {_g(a.get('beta'))}), abort when the "
                   f"upper < {_pct(a.get('abort_at'))} (alpha {_g(a.get('alpha'))})")
        floor = a.get("self_agreement")
        if isinstance(floor, dict):
            out.append(f"  noise floor  the primary agrees with itself "
                       f"{_pct(floor.get('estimate'))} over {floor.get('samples')}, bounds "
                       f"[{_pct(floor.get('lower'))}, "
                       f"{_pct(floor.get('upper'))}] (carried through the ratio)")
    lat = ev.get("latency") or {}
    if lat:
        out.append(f"  latency  slower than {lat.get('margin')} in {_pct(lat.get('estimate'))} of "
                   f"{lat.get('samples', 0)} pairs, bounds [{_pct(lat.get('lower'))}, "
                   f"{_pct(lat.get('upper'))}]: {lat.get('test')}; abort when the lower > 50 %, "
                   f"promote needs the upper < 50 %")
        tail = lat.get("tail") or {}
        if tail and not tail.get("judged"):
            out.append(f"  latency {tail.get('name')}  not judged yet: a distribution-free bound "
                       f"needs {tail.get('supported_from')} pairs, {lat.get('samples', 0)} so far")
        elif tail:
            p, c = tail.get("production") or {}, tail.get("canary") or {}
            out.append(f"  latency {tail.get('name')}  production ≤ {_ms(p.get('upper_ms'))}, "
                       f"canary ≥ {_ms(c.get('lower_ms'))} (distribution-free anytime bounds)")
    for line in snap.get("missing") or []:
        out.append(f"  missing: {line}")
    return "\n".join(out) + "\n"


def _g(x: Any) -> str:
    return f"{x:.2g}" if isinstance(x, int | float) else "-"


def _fixed(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() + "\n"
                   for r in rows)


def _ci(ci: Any) -> str:
    if not isinstance(ci, list) or len(ci) != 2:
        return "-"
    return f"[{_num(ci[0]):.1%}, {_num(ci[1]):.1%}]"


def robustness_rows(snap: dict[str, Any]) -> list[list[str]]:
    """Header + one row per perturbation: each side's robustness with its anytime bounds, the
    difference (canary − production, in points) with its paired anytime bounds, the pairs and
    the test's outcome (passes / fails / undecided / not judged yet)."""
    rows = [["perturbation", "pairs", "production", "bounds", "canary", "bounds", "difference",
             "bounds", "verdict"]]
    for row in ((snap.get("robustness") or {}).get("rows") or []):
        p, c = row.get("production") or {}, row.get("canary") or {}
        diff = row.get("difference")
        dci = row.get("difference_bounds", row.get("difference_ci95"))
        rows.append([str(row.get("perturbation", "?")), str(row.get("samples", 0)),
                     _pct(p.get("robustness")), _ci(p.get("bounds", p.get("ci95"))),
                     _pct(c.get("robustness")), _ci(c.get("bounds", c.get("ci95"))),
                     f"{_num(diff) * 100:+.1f} pts" if isinstance(diff, int | float) else "-",
                     (f"[{_num(dci[0]) * 100:+.1f}, {_num(dci[1]) * 100:+.1f}]"
                      if isinstance(dci, list) and len(dci) == 2 else "-"),
                     str(row.get("verdict", "-"))])
    return rows


def exit_code(shadows: dict[str, dict[str, Any]]) -> int:
    return EXIT_ABORT if any(s.get("state") == "abort" for s in shadows.values()) else EXIT_OK


def _num(x: Any) -> float:
    return float(x) if isinstance(x, int | float) else 0.0


def _svg_histogram(title: str, edges: list[Any], series: list[tuple[str, list[Any], str]],
                   width: int = 360, height: int = 180) -> str:
    """Bars of each series over the same bins, side by side within a bin; axis ends labelled."""
    left, bottom, top = 36, 28, 22
    plot_w, plot_h = width - left - 8, height - bottom - top
    bins = max(len(edges) - 1, 1)
    peak = max((_num(c) for _, counts, _ in series for c in counts), default=0.0) or 1.0
    bar_w = plot_w / bins / max(len(series), 1)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'role="img" aria-label="{escape(title)}">',
             f'<text x="{left}" y="14" font-size="12">{escape(title)}</text>',
             f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" '
             f'stroke="#333"/>',
             f'<text x="4" y="{top + 10}" font-size="10">{peak:.0f}</text>']
    for s, (label, counts, colour) in enumerate(series):
        for i, count in enumerate(counts[:bins]):
            h = _num(count) / peak * plot_h
            x = left + i * plot_w / bins + s * bar_w
            lo, hi = _num(edges[i]), _num(edges[i + 1]) if i + 1 < len(edges) else 0.0
            parts.append(f'<rect x="{x:.1f}" y="{top + plot_h - h:.1f}" width="{bar_w:.1f}" '
                         f'height="{h:.1f}" fill="{colour}"><title>{escape(label)} '
                         f'[{lo:.4g}, {hi:.4g}): {_num(count):.0f}</title></rect>')
        if len(series) > 1:
            parts.append(f'<text x="{left + plot_w - 110 + 60 * s}" y="14" font-size="11" '
                         f'fill="{colour}">■ {escape(label)}</text>')
    if edges:
        parts.append(f'<text x="{left}" y="{height - 8}" font-size="10">'
                     f'{_num(edges[0]):.4g}</text>')
        parts.append(f'<text x="{left + plot_w}" y="{height - 8}" font-size="10" '
                     f'text-anchor="end">{_num(edges[-1]):.4g}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _svg_robustness(snap: dict[str, Any], width: int = 520) -> str:
    """Per perturbation, a bar per side (share of clean answers kept) with its 95 % interval as
    a whisker: where the canary's bar sits below production's, it is less robust."""
    rows = (snap.get("robustness") or {}).get("rows") or []
    if not rows:
        return ""
    left, top, row_h = 110, 24, 34
    plot_w = width - left - 60
    height = top + row_h * len(rows) + 24
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'role="img" aria-label="robustness per perturbation">',
             '<text x="4" y="14" font-size="12">robustness: share of clean answers kept '
             '(95 % CI)</text>']
    for side_i, side in enumerate(("production", "canary")):
        colour = _COLOURS["primary" if side == "production" else "canary"]
        parts.append(f'<text x="{left + plot_w - 150 + 80 * side_i}" y="14" font-size="11" '
                     f'fill="{colour}">■ {side}</text>')
    for i, row in enumerate(rows):
        y0 = top + i * row_h
        parts.append(f'<text x="4" y="{y0 + 18}" font-size="11">'
                     f'{escape(str(row.get("perturbation", "?")))}</text>')
        for side_i, side in enumerate(("production", "canary")):
            fig = row.get(side) or {}
            colour = _COLOURS["primary" if side == "production" else "canary"]
            value, ci = fig.get("robustness"), fig.get("ci95") or [0, 0]
            y = y0 + 4 + side_i * 13
            w = _num(value) * plot_w
            lo, hi = left + _num(ci[0]) * plot_w, left + _num(ci[1]) * plot_w
            parts.append(f'<rect x="{left}" y="{y}" width="{w:.1f}" height="11" '
                         f'fill="{colour}"><title>{side}: {_pct(value)} {_ci(ci)} over '
                         f'{_num(row.get("samples")):.0f} pairs</title></rect>')
            parts.append(f'<line x1="{lo:.1f}" y1="{y + 5.5}" x2="{hi:.1f}" y2="{y + 5.5}" '
                         f'stroke="#222"/>')
            parts.append(f'<text x="{left + plot_w + 4}" y="{y + 10}" font-size="10">'
                         f'{_pct(value)}</text>')
    axis_y = top + row_h * len(rows)
    parts.append(f'<line x1="{left}" y1="{axis_y}" x2="{left + plot_w}" y2="{axis_y}" '
                 f'stroke="#333"/><text x="{left}" y="{axis_y + 14}" font-size="10">0 %</text>'
                 f'<text x="{left + plot_w}" y="{axis_y + 14}" font-size="10" '
                 f'text-anchor="end">100 %</text></svg>')
    return "".join(parts)


def _html_table(rows: list[list[str]], header: bool = True) -> str:
    out = ["<table>"]
    for i, row in enumerate(rows):
        tag = "th" if header and i == 0 else "td"
        out.append("<tr>" + "".join(f"<{tag}>{escape(c)}</{tag}>" for c in row) + "</tr>")
    return "".join(out) + "</table>"


def _route_section(route: str, snap: dict[str, Any]) -> str:
    state = str(snap.get("state", "?"))
    colour = _STATE_COLOURS.get(state, "#bbbbbb")
    latency = snap.get("latency_ms") or {}
    summary = [
        ["canary", str(snap.get("canary", "-"))],
        ["samples", f"{snap.get('samples', 0)} ({snap.get('agreed', '-')} agreed)"],
        ["agreement", _pct(snap.get("agreement"))],
        ["primary self-agreement",
         f"{_pct(snap.get('self_agreement'))} over {snap.get('noise_samples', 0)}"],
        ["effective agreement", _pct(snap.get("effective_agreement"))],
        ["copies a fault touched (left out)", str(snap.get("excluded", "-"))],
        ["latency p50 primary / canary", f"{_ms(latency.get('primary', {}).get('p50'))} / "
                                         f"{_ms(latency.get('canary', {}).get('p50'))}"],
        ["latency p99 primary / canary", f"{_ms(_p99(snap, 'primary'))} / "
                                         f"{_ms(_p99(snap, 'canary'))}"],
    ] + [[str(k), "-" if v is None else str(v)]
         for k, v in (snap.get("thresholds") or {}).items()]
    parts = [f'<section><h2>{escape(route)} <span class="state" style="background:{colour}">'
             f"{escape(state.upper())}</span></h2>", _html_table(summary, header=False)]
    if snap.get("reasons"):
        parts.append("<ul>" + "".join(f"<li>{escape(str(r))}</li>" for r in snap["reasons"])
                     + "</ul>")
    evidence = evidence_text(route, snap)
    if evidence:
        parts.append(f"<h3>evidence (anytime-valid bounds, tests, error rates)</h3>"
                     f"<pre>{escape(evidence.strip())}</pre>")
    robustness = robustness_rows(snap)
    if len(robustness) > 1:
        parts.append("<h3>robustness (same seeded perturbation on both sides)</h3>"
                     + _svg_robustness(snap) + _html_table(robustness))
    metrics: dict[str, dict[str, Any]] = snap.get("metrics") or {}
    if metrics:
        cols = ["p50", "p90", "p99", "min", "max"]
        parts.append(_html_table([["metric", *cols]] + [
            [str(name), *(f"{_num(q.get(c)):.4g}" for c in cols)]
            for name, q in sorted(metrics.items())]))
    plots = []
    histograms = snap.get("histograms") or {}
    for name, h in sorted((histograms.get("metrics") or {}).items()):
        plots.append(_svg_histogram(str(name), list(h.get("edges", [])),
                                    [(str(name), list(h.get("counts", [])), "#4477aa")]))
    lat = histograms.get("latency_ms") or {}
    if lat:
        plots.append(_svg_histogram("latency (ms)", list(lat.get("edges", [])), [
            (side, list(lat.get(side, [])), _COLOURS[side]) for side in ("primary", "canary")]))
    parts.append('<div class="plots">' + "".join(plots) + "</div>")
    disagreements = snap.get("disagreements") or []
    if disagreements:
        parts.append("<h3>latest disagreements</h3>" + _html_table(
            [["at", "reason"]] + [[f"{_num(d.get('at')):.3f}", str(d.get("reason", ""))]
                                  for d in reversed(disagreements)]))
    return "".join(parts) + "</section>"


def render_html(shadows: dict[str, dict[str, Any]]) -> str:
    """A whole page; every string that came from the data is HTML-escaped."""
    body = ("".join(_route_section(r, s) for r, s in sorted(shadows.items()))
            or "<p>no shadowed routes (no route uses the shadow filter)</p>")
    return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>mmguard canary report"
            "</title><style>body{font-family:sans-serif;margin:2em}table{border-collapse:"
            "collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 8px;text-align:left}"
            ".state{color:#fff;padding:0 .4em;border-radius:3px}.plots svg{margin:4px}"
            "</style></head><body><h1>mmguard canary report</h1>"
            + _html_table([["route", "canary", "state", "samples", "agreement", "effective",
                            "p99 primary", "p99 canary", "reasons"]]
                          + [_summary(r, s) for r, s in sorted(shadows.items())])
            + body + "</body></html>\n")


def main(args: argparse.Namespace) -> int:
    admin: str = args.admin
    try:
        shadows = fetch_shadows(admin, timeout=args.timeout)
    except Unreachable as e:
        print(f"mmguard canary-report: cannot read the admin API at {admin}: {e}",
              file=sys.stderr)
        return EXIT_UNREACHABLE
    if args.json:
        print(json.dumps(shadows, indent=2, sort_keys=True))
    else:
        sys.stdout.write(render_table(shadows))
    if args.html is not None:
        Path(args.html).write_text(render_html(shadows), encoding="utf-8")
        print(f"wrote {args.html}", file=sys.stderr)  # stderr: --json keeps stdout pure JSON
    return exit_code(shadows)
