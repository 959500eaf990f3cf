"""``mmguard canary-report``: the table, the HTML page, and the CLI against a real aiohttp admin
server on 127.0.0.1:0 that serves a fixed ``/admin/shadows`` document."""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from filters.compare import Comparison, Verdict, VerdictConfig
from proxy.cli.main import main as cli
from proxy.cli.report import render_html, render_table
from proxy.clock import ManualClock
from tests.support.loop import BackgroundLoop

EVIL = "<script>alert('x')</script>"


def snapshot(agreed: int, total: int, canary_s: float = 0.0102, route: str = "") -> dict[str, Any]:
    """A real ``Verdict.snapshot()`` through JSON: the admin API's wire shape (disagreements
    spread evenly over the ``total``)."""
    v = Verdict(VerdictConfig(window=100, min_samples=10), ManualClock())
    for i in range(total):
        ok = (i * agreed) // total != ((i + 1) * agreed) // total
        v.add(Comparison(ok, {"cosine": 1.0 if ok else 0.8, "max_abs": 0.0 if ok else 0.3},
                         "" if ok else f"output 'logits{route}': cosine 0.800 < 0.990"),
              0.010, canary_s)
    doc: dict[str, Any] = json.loads(json.dumps(v.snapshot()))
    return doc


def shadows(abort: bool = True) -> dict[str, dict[str, Any]]:
    return {"clip": {"canary": "clip_canary", **snapshot(1100, 1100)},
            "llm": {"canary": "llm_v2", **snapshot(25 if abort else 50, 50)},
            "new": {"canary": "new_canary", **snapshot(3, 3)}}


def cells(out: str, first: str) -> list[str]:
    (line,) = [ln for ln in out.splitlines() if ln.split()[:1] == [first]]
    return re.split(r"\s{2,}", line.strip())


def test_table_has_one_row_per_route() -> None:
    out = render_table(shadows())
    header = cells(out, "route")
    assert header == ["route", "canary", "state", "samples", "agreement", "effective",
                      "p99 primary", "p99 canary", "reasons"]
    clip = cells(out, "clip")
    assert clip[:8] == ["clip", "clip_canary", "PROMOTE", "1100", "100.0%", "100.0%",
                        "10.0 ms", "10.2 ms"]
    # a promote carries its evidence: the bound, its error rate, the test
    assert clip[8].startswith("effective agreement ≥ 99.5")
    assert "anytime lower bound, false-promote rate 0.05" in clip[8]
    llm = cells(out, "llm")
    assert llm[:3] == ["llm", "llm_v2", "ABORT"]
    # an abort latches with the figures of the moment it fell
    assert llm[8].startswith("effective agreement ≤ ") and "< abort line 95.0%" in llm[8]
    assert "latest disagreement: output 'logits'" in llm[8]
    assert cells(out, "new")[:4] == ["new", "new_canary", "COLLECTING", "3"]
    # below the table: each figure with its bounds, test, error rates, and what is missing
    assert "verdict of clip vs clip_canary: PROMOTE at 1" in out
    assert "alpha 0.01 (false abort, split over 3 abort tests), beta 0.05" in out
    assert "  agreement  100.0% of 1100, bounds [99.5%, 100.0%]" in out
    assert "  latency p99  not judged yet: a distribution-free bound needs" in out
    assert "  missing: 3 of 10 samples collected" in out
    # fixed-width: every column starts at the same offset on each row
    head, clip_line, llm_line, new = out.splitlines()[:4]
    assert clip_line.index("clip_canary") == llm_line.index("llm_v2") == head.index("canary")
    assert clip_line.index("PROMOTE") == llm_line.index("ABORT") == new.index("COLLECTING")
    assert render_table({}) == "no shadowed routes (no route uses the shadow filter)\n"


def test_html_is_self_contained_escapes_the_data_and_plots_svg() -> None:
    doc = shadows()
    doc[EVIL] = {"canary": EVIL, **snapshot(5, 20, route=EVIL)}
    page = render_html(doc)
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert "<script" not in page.lower()
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in page
    assert page.count("<svg") >= 4 * 3  # cosine, latency_diff_ms, max_abs, latency per route
    assert "http" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "latency (ms)" in page and "ABORT" in page


def close(loop: BackgroundLoop) -> None:
    loop.close()
    loop.loop.close()  # stopped, not closed, by BackgroundLoop.close


@contextmanager
def admin_serving(doc: dict[str, Any]) -> Iterator[str]:
    loop = BackgroundLoop()

    async def start() -> web.AppRunner:
        async def list_shadows(request: web.Request) -> web.Response:
            return web.json_response(doc)

        app = web.Application()
        app.router.add_get("/admin/shadows", list_shadows)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner

    runner = loop.run(start())
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        loop.run(runner.cleanup())
        close(loop)


def test_cli_prints_the_table_writes_the_html_and_exits_3_on_an_abort(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    page = tmp_path / "report.html"
    with admin_serving(shadows()) as url:
        code = cli(["canary-report", "--admin", url, "--html", str(page)])
    out, err = capsys.readouterr()
    assert code == 3
    assert cells(out, "llm")[2] == "ABORT" and cells(out, "clip")[2] == "PROMOTE"
    assert f"wrote {page}" in err
    html = page.read_text(encoding="utf-8")
    assert "<svg" in html and "llm_v2" in html


def test_cli_exits_0_when_nothing_aborts_and_prints_json_on_request(
        capsys: pytest.CaptureFixture[str]) -> None:
    doc = shadows(abort=False)
    with admin_serving(doc) as url:
        assert cli(["canary-report", "--admin", url]) == 0
        capsys.readouterr()
        assert cli(["canary-report", "--admin", url.removeprefix("http://"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == doc


def test_cli_exits_2_naming_the_url_when_nothing_listens(
        capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"  # the socket is closed: nothing listens there
    assert cli(["canary-report", "--admin", url]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert f"cannot read the admin API at {url}" in err


def test_cli_exits_2_when_the_admin_api_has_no_shadows(
        capsys: pytest.CaptureFixture[str]) -> None:
    loop = BackgroundLoop()

    async def start() -> web.AppRunner:
        runner = web.AppRunner(web.Application())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner

    runner = loop.run(start())
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        assert cli(["canary-report", "--admin", url]) == 2
    finally:
        loop.run(runner.cleanup())
        close(loop)
    assert f"{url}/admin/shadows answered HTTP 404" in capsys.readouterr().err
