"""The ``mmguard`` command as an operator meets it: ``--version``, ``--log-level``, a pipe
closed by ``head`` (no traceback), a correct start without a WARNING, and no versions in the
``Server`` header."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from proxy import __version__
from tests.support.process import MmguardProcess

ROOT = Path(__file__).parents[2]


def cli(*args: str, stdout: int | None = subprocess.PIPE) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "proxy.cli", *args], cwd=ROOT, stdout=stdout,
                          stderr=subprocess.PIPE, text=True, timeout=60)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MmguardProcess]:
    """``mmguard serve`` with the embedded default: a correct start."""
    proc = MmguardProcess([], tmp_path_factory.mktemp("serve") / "serve.log")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def test_version() -> None:
    done = cli("--version")
    assert (done.returncode, done.stdout.strip()) == (0, f"mmguard {__version__}")


def test_a_correct_start_logs_no_warning(served: MmguardProcess) -> None:
    levels = [r.get("level") for r in served.records()]
    assert levels and levels[0] == "info"
    assert not [r for r in served.records() if r.get("level") in ("warning", "error")], \
        served.log_path.read_text()[-2000:]


@pytest.mark.parametrize("command", [["status"], ["canary-report", "--json"]])
def test_a_closed_pipe_ends_quietly(served: MmguardProcess, command: list[str]) -> None:
    """``mmguard status | head -0``: the reader is gone before the first write."""
    read, write = os.pipe()
    os.close(read)
    try:
        done = cli(*command, "--admin", f"http://127.0.0.1:{served.ports['admin']}",
                   stdout=write)
    finally:
        os.close(write)
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
    assert done.returncode == 141  # as a command killed by SIGPIPE, for `set -o pipefail`


@pytest.mark.parametrize("port", ["http", "admin"])
def test_the_server_header_names_no_version(served: MmguardProcess, port: str) -> None:
    path = "/v2/health/ready" if port == "http" else "/metrics"
    with urllib.request.urlopen(f"http://127.0.0.1:{served.ports[port]}{path}", timeout=10) as r:
        assert r.headers["Server"] == "mmguard"


def test_log_level_flag(tmp_path: Path) -> None:
    """``--log-level warning`` over the config's info: a backend that never answers still
    says so (WARNING), and no INFO line is written (not even the ports)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    config = tmp_path / "mmguard.yaml"
    config.write_text(yaml.safe_dump({
        "backends": [{"kind": "triton_http", "name": "t", "url": f"127.0.0.1:{dead}"}],
        "models": [{"name": "m", "backend": "t"}]}))
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "proxy.cli", "serve", "--config",
                                 str(config), "--http-port", "0", "--grpc-port", "0",
                                 "--admin-port", "0", "--log-level", "warning"], cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while '"level": "warning"' not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(30)
    levels = [json.loads(line)["level"] for line in log.read_text().splitlines()]
    assert "warning" in levels and "info" not in levels, levels
    done = cli("serve", "--log-level", "loud")
    assert done.returncode == 2 and "invalid choice: 'loud'" in done.stderr
