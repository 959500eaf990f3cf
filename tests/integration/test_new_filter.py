"""A new filter, added the way docs/filters.md says, shows in a real ``mmguard`` without any
change to ``proxy``: its package declares an entry point in the ``mmguard.filters`` group, and
once the package is installed (its metadata on the path: what ``pip install`` leaves) the config
may name it, the chain runs it and ``mmguard status`` shows its table from ``GET /admin``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.conftest import ort_config
from tests.support.process import MmguardProcess

ROOT = Path(__file__).parents[2]

FILTER = '''
"""A throwaway filter: counts the calls it saw per route and says so on each answer."""

from proxy.call import Call, Reply
from proxy.chain import FilterContext, Next
from proxy.lifecycle import AdminRequest, FilterFactoryBase, StateKey, Summary
from proxy.strict import Strict

SEEN: StateKey[dict[str, int]] = StateKey("hello_seen")


class HelloConfig(Strict):
    greeting: str = "hi"


class Hello:
    def __init__(self, cfg: HelloConfig, ctx: FilterContext) -> None:
        self.cfg, self.ctx = cfg, ctx
        self.seen = ctx.state.setdefault(SEEN, dict)

    async def __call__(self, call: Call, next: Next) -> Reply:
        self.seen[self.ctx.route] = self.seen.get(self.ctx.route, 0) + 1
        self.ctx.telemetry.decide(call, "hello", self.cfg.greeting)
        return await next(call)


class HelloFactory(FilterFactoryBase):
    name = "hello"
    config_model = HelloConfig

    def build(self, config: HelloConfig, ctx: FilterContext) -> Hello:
        return Hello(config, ctx)

    async def summary(self, req: AdminRequest) -> Summary:
        seen = req.state.get(SEEN) or {}
        return Summary("hello calls", ("route", "calls"),
                       tuple((route, str(n)) for route, n in sorted(seen.items())))
'''


def throwaway_package(where: Path) -> Path:
    """The filter's module and the metadata an install of its package leaves."""
    where.mkdir()
    (where / "hello_filter.py").write_text(FILTER)
    dist = where / "hello_filter-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: hello-filter\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[mmguard.filters]\nhello = hello_filter:HelloFactory\n")
    return where


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "proxy.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def config(tmp_path: Path, ort_models: Path) -> Path:
    cfg = ort_config(ort_models)
    cfg["models"][0]["filters"] = [{"hello": {"greeting": "hello there"}}]
    path = tmp_path / "mmguard.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_an_uninstalled_filter_is_unknown_and_the_error_names_the_reinstall(
        config: Path) -> None:
    done = cli("check-config", str(config), env=dict(os.environ))
    assert done.returncode != 0
    assert "unknown filter 'hello'" in done.stderr + done.stdout
    assert "pip install -e ." in done.stderr + done.stdout


def test_an_installed_filter_runs_and_shows_in_status(config: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    site = throwaway_package(tmp_path / "site")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(site), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    mmguard = MmguardProcess(["--config", str(config)], tmp_path / "mmguard.log")
    try:
        mmguard.wait_ready()
        admin = f"http://127.0.0.1:{mmguard.ports['admin']}"
        http = f"http://127.0.0.1:{mmguard.ports['http']}"
        body = json.dumps({"inputs": [
            {"name": "pixel_values", "datatype": "FP32", "shape": [1, 3, 224, 224],
             "data": [0.5] * (3 * 224 * 224)},
            {"name": "input_ids", "datatype": "INT64", "shape": [1, 77], "data": [1] * 77}]})
        req = urllib.request.Request(f"{http}/v2/models/clip_demo/infer", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as answer:
            assert answer.status == 200
            assert answer.headers["mmguard-hello"] == "hello there"
        with urllib.request.urlopen(f"{admin}/admin", timeout=10) as index:
            listed = json.load(index)["filters"]
        assert listed["hello"]["summary"]["rows"] == [["clip_demo", "1"]]
        assert {"fallback", "fault", "shadow"} <= set(listed)
        done = cli("status", "--admin", admin, env=dict(os.environ))
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        at = lines.index("hello calls")
        assert lines[at + 1].split() == ["route", "calls"]
        assert lines[at + 2].split() == ["clip_demo", "1"]
    finally:
        mmguard.stop()
