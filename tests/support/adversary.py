"""The adversarial tier's harness: a real ``mmguard serve`` process, a probe client that sends a
good request every 100 ms while an attack runs, and the process's resident memory.

An attack test asserts three things: the attack's own answer (status and message), that every
probe was answered correctly and none waited longer than the liveness bound, and how far the
process's RSS moved. Bounds are generous (a busy 2-core CI machine runs these): they catch a
stalled event loop (seconds) or a gigabyte held, never a few milliseconds.
"""

from __future__ import annotations

import copy
import http.client
import json
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.support.process import MmguardProcess

PROBE_BODY = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [2],
                                     "data": [1.0, 2.0]}]}).encode()
PROBE_PATH = "/v2/models/identity_fp32/infer"
PROBE_WAIT_S = 1.0
"""A probe that waits longer than this saw a stalled proxy (the issue's bound)."""

ADMIN_TOKEN = f"adversary-admin-token-{secrets.token_hex(8)}"
"""The admin token of every ``serve``d process that names none: the log must never hold it."""
CLIENT_CREDENTIAL = f"adversary-client-credential-{secrets.token_hex(8)}"
"""Every ``http_call`` sends ``Authorization: Bearer`` this (unless it sends its own): the log
must never hold a client's credential either."""


def rss_mib(pid: int) -> float:
    """Resident set size of a process, in MiB (from /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def http_call(port: int, method: str, path: str, body: bytes | None = None,
              headers: dict[str, str] | None = None,
              timeout: float = 30) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    sent = dict(headers or {})
    if not any(k.lower() == "authorization" for k in sent):
        sent["Authorization"] = f"Bearer {CLIENT_CREDENTIAL}"
    try:
        conn.request(method, path, body=body, headers=sent)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    finally:
        conn.close()


MIN_PROBES = 3
"""Probes a ``Prober`` sends at least, however short the attack it watches."""


@dataclass
class ProbeRecord:
    sent: float
    waited: float
    status: int | None
    error: str = ""
    connecting: float = 0.0
    """Of ``waited``, the TCP connect: about 1 s here means the kernel dropped the first
    attempt (a full accept queue), not a slow answer."""


def listen_overflows() -> int | None:
    """The kernel's count of connection attempts dropped at a full accept queue (``TcpExt:
    ListenOverflows``, all sockets of the host); None where /proc does not say."""
    try:
        lines = Path("/proc/net/netstat").read_text().splitlines()
    except OSError:
        return None
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            row = dict(zip(names.split()[1:], values.split()[1:], strict=False))
            return int(row["ListenOverflows"]) if "ListenOverflows" in row else None
    return None


@dataclass
class Prober:
    """Sends ``PROBE_BODY`` to ``PROBE_PATH`` every ``interval`` seconds from its own thread,
    on a fresh connection each time (a stalled proxy then shows as a slow connect or answer)."""

    port: int
    interval: float = 0.1
    path: str = PROBE_PATH
    body: bytes = PROBE_BODY
    records: list[ProbeRecord] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _overflows: list[int | None] = field(default_factory=list)

    def __enter__(self) -> Prober:
        self._overflows = [listen_overflows()]
        self._thread = threading.Thread(target=self._run, name="prober", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        # an attack refused in a few ms still gets its probes: a few after it, whose answers
        # show the proxy kept serving once it was over
        deadline = time.monotonic() + 30
        while len(self.records) < MIN_PROBES and time.monotonic() < deadline:
            time.sleep(self.interval / 2)
        self._stop.set()
        assert self._thread is not None
        self._thread.join(30)
        self._overflows.append(listen_overflows())

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            connecting = 0.0
            try:
                conn.connect()
                connecting = time.monotonic() - t0
                conn.request("POST", self.path, body=self.body,
                             headers={"Authorization": f"Bearer {CLIENT_CREDENTIAL}"})
                answer = conn.getresponse()
                status, body = answer.status, answer.read()
                ok = status == 200 and json.loads(body)["outputs"][0]["data"] == [1.0, 2.0]
                err = "" if ok else f"answer {status}: {body[:200]!r}"
            except Exception as exc:  # a refused or dropped connection is what we look for
                status, err = None, f"{type(exc).__name__}: {exc}"
            finally:
                conn.close()
            self.records.append(ProbeRecord(t0, time.monotonic() - t0, status, err, connecting))
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - t0)))

    def assert_served(self, max_wait: float = PROBE_WAIT_S, minimum: int = MIN_PROBES) -> None:
        """Every probe answered correctly, none waited longer than ``max_wait``."""
        assert len(self.records) >= minimum, f"only {len(self.records)} probes were sent"
        bad = [r for r in self.records if r.error]
        assert not bad, f"{len(bad)}/{len(self.records)} probes failed, first: {bad[0].error}"
        worst = max(self.records, key=lambda r: r.waited)
        first, last = [*self._overflows, None, None][:2]
        dropped = ("unknown" if first is None or last is None else last - first)
        assert worst.waited <= max_wait, (
            f"a probe waited {worst.waited:.2f} s (bound {max_wait} s) of {len(self.records)} "
            f"probes, {worst.connecting:.2f} s of it to connect; connection attempts the "
            f"kernel dropped at a full accept queue meanwhile (ListenOverflows): {dropped}")


def write_config(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def assert_log_holds_no_secret(log_path: Path, secret_values: list[str]) -> None:
    """The whole log of a served process: no secret, no third-party traceback of client input
    (aiohttp's ``Error handling request`` with the raw bytes it quotes)."""
    text = log_path.read_text(errors="replace")
    for value in secret_values:
        assert value not in text, f"the log {log_path} holds a secret ({value[:12]}...)"
    assert "Error handling request" not in text, f"aiohttp's own traceback in {log_path}"


def _secrets(config: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``config`` with the adversary's admin token unless it names one; the secrets to look
    for in its log."""
    config = copy.deepcopy(config)
    admin = config.setdefault("listeners", {}).setdefault("admin", {})
    if not any(k in admin for k in ("token", "token_file", "token_env")):
        admin["token"] = ADMIN_TOKEN
    found = [CLIENT_CREDENTIAL]
    if isinstance(admin.get("token"), str):
        found.append(admin["token"])
    return config, found


@contextmanager
def serve(tmp_path: Path, config: dict[str, Any], ready_timeout: float = 90,
          args: tuple[str, ...] = (), nofile: int | None = None) -> Iterator[MmguardProcess]:
    """``mmguard serve --config`` as a real process on free ports, ready before it is yielded.
    The process is stopped (SIGTERM, then SIGKILL) afterwards; its log stays in ``tmp_path``.
    Every attack of the tier is then checked for secrets in the log: the process has an admin
    token (``ADMIN_TOKEN`` unless the config names one), every ``http_call`` carries a client
    credential, and after a clean exit neither may be in the log."""
    config, secret_values = _secrets(config)
    cfg = write_config(tmp_path / "mmguard.yaml", config)
    proc = MmguardProcess(["--config", str(cfg), *args], tmp_path / "mmguard.log", nofile=nofile)
    try:
        proc.wait_ready(ready_timeout)
        yield proc
    except BaseException:
        proc.stop()
        raise
    proc.stop()
    assert_log_holds_no_secret(proc.log_path, secret_values)
