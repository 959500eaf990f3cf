"""Run ``mmguard serve`` as a real process and read the ports it logs."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


class MmguardProcess:
    def __init__(self, args: list[str], log_path: Path, nofile: int | None = None) -> None:
        """``nofile``: the process's open-files limit, soft and hard (as a container sets it)."""
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}

        def limit() -> None:
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "proxy.cli", "serve", "--http-port", "0", "--grpc-port", "0",
             "--admin-port", "0", *args], stdout=self._log, stderr=subprocess.STDOUT, env=env,
            preexec_fn=limit if nofile is not None else None)
        self.ports = self._wait_for_ports()

    def _wait_for_ports(self, timeout: float = 60) -> dict[str, int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for rec in self.records():
                if "http_port" in rec:
                    return {k: int(str(rec[f"{k}_port"])) for k in ("http", "grpc", "admin")}
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"mmguard did not start:\n{self.log_path.read_text()[-3000:]}")

    def wait_ready(self, timeout: float = 90) -> None:
        """Poll ``GET /v2/health/ready`` until 200: the ports are logged when the listeners bind,
        which on a busy machine can be well before the embedded models have loaded."""
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{self.ports['http']}/v2/health/ready"
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url, timeout=5) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"mmguard never became ready:\n{self.log_path.read_text()[-3000:]}")

    def records(self) -> list[dict[str, object]]:
        out = []
        for line in self.log_path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def wait_log(self, text: str, timeout: float = 30) -> dict[str, object]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for rec in self.records():
                if text in str(rec.get("msg", "")):
                    return rec
            time.sleep(0.1)
        raise AssertionError(f"no log line with {text!r}:\n{self.log_path.read_text()[-3000:]}")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self._log.close()
