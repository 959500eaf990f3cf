"""What the benchmarks in bench/ share: process handling, the machine's description, CPU
accounting from /proc, mmguard as a child process, and plain-text / Markdown tables (the
load-generator process and its recorder are in :mod:`bench.loadgen`).

Used by ``python -m bench.proxy`` (Triton, ONNX Runtime), ``python -m bench.openai`` (vLLM),
``python -m bench.workers`` and the others: ``from bench.common import ...``.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tests.support.triton import free_ports as free_ports  # one port picker, re-exported

ROOT = Path(__file__).resolve().parents[1]
NOISY_OTHER_PCT = 5.0  # a cell where other processes took more of the machine is flagged


# ---------------------------------------------------------------------------------------------
# Processes, ports, HTTP probes
# ---------------------------------------------------------------------------------------------


def pdeathsig() -> None:
    """In a child, before exec: get SIGTERM when the parent dies (even by SIGKILL)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def http_status(url: str, timeout: float = 2.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return None


def http_json(url: str, timeout: float = 2.0) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError):
        return None


def stop_process(proc: subprocess.Popen[bytes] | None, sig: int = signal.SIGTERM,
                 timeout: float = 15.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    try:
        proc.send_signal(sig)
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
    except ProcessLookupError:
        pass


# ---------------------------------------------------------------------------------------------
# The machine
# ---------------------------------------------------------------------------------------------


def machine_info(dists: Sequence[str], nginx: bool = True) -> dict[str, Any]:
    """CPU, memory, kernel, versions of ``dists`` (and nginx's when installed), git state."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    try:
        nproc = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    except OSError:
        nproc = str(len(os.sched_getaffinity(0)))
    versions: dict[str, str] = {"python": platform.python_version()}
    for dist in dists:
        try:
            from importlib.metadata import version
            versions[dist] = version(dist)
        except Exception:
            pass
    binary = shutil.which("nginx") if nginx else None
    if binary:
        out = subprocess.run([binary, "-v"], capture_output=True, text=True)
        versions["nginx"] = (out.stderr or out.stdout).strip().split("/")[-1]
    git: dict[str, Any] = {}
    try:
        git["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                       capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "proxy", "filters"],
                               cwd=ROOT, capture_output=True, text=True).stdout.split("\n")
        git["uncommitted_in_proxy_or_filters"] = [ln[3:] for ln in dirty if ln.strip()]
    except OSError:
        pass
    return {"nproc": nproc, "cpu_model": model, "mem_gib": mem_gib,
            "kernel": platform.release(), "versions": versions, "git": git}


def git_line(info: dict[str, Any]) -> str:
    git = info.get("git") or {}
    dirty = git.get("uncommitted_in_proxy_or_filters") or []
    return f"commit {git.get('commit', '?')}" + (
        f" + uncommitted changes in {', '.join(dirty)}" if dirty else "")


# --- CPU accounting from /proc ------------------------------------------------------------------

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the comm field may hold spaces: split after its closing parenthesis
    return raw[raw.rfind(")") + 2:].split()


def proc_minflt(pid: int) -> float:
    """Minor page faults of a process so far (memory it touched for the first time)."""
    f = _stat_fields(pid)
    return 0.0 if f is None else float(f[7])  # minflt (field 10)


def proc_cpu_s(pid: int) -> float:
    f = _stat_fields(pid)
    if f is None:
        return 0.0
    return (int(f[11]) + int(f[12])) / CLK_TCK  # utime, stime (fields 14, 15)


def group_cpu_s(pgid: int) -> float:
    """CPU of every process in a process group (a server and its children)."""
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        f = _stat_fields(int(entry))
        if f is not None and int(f[2]) == pgid:  # field 5: pgrp
            total += (int(f[11]) + int(f[12])) / CLK_TCK
    return total


def runq_wait_s(pid: int) -> float:
    """Seconds a thread has spent runnable but waiting for a CPU (``/proc/<pid>/schedstat``,
    second field; for a process's pid: its main thread, where an asyncio loop runs)."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies from /proc/stat's aggregate line."""
    parts = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    vals = [int(v) for v in parts[:8]]
    idle = vals[3] + vals[4]  # idle + iowait
    return float(sum(vals) - idle), float(sum(vals))


def busy_before(info: dict[str, Any], seconds: float = 1.0) -> None:
    """Record how busy the machine is before the start (``info["busy_before_pct"]``); warn
    when it is over 10 %."""
    b0 = machine_busy()
    time.sleep(seconds)
    b1 = machine_busy()
    info["busy_before_pct"] = round(100 * (b1[0] - b0[0]) / max(b1[1] - b0[1], 1), 1)
    if info["busy_before_pct"] > 10:
        print(f"warning: the machine is already {info['busy_before_pct']}% busy before the "
              "benchmark starts; results will be noisy (see 'other CPU %' per cell)", flush=True)


class CpuWindow:
    """CPU each probed process (and the whole machine) used between two samples.

    ``probes``: name -> function giving that process's (or group's) CPU seconds so far.
    ``waits`` (optional): name -> function giving a thread's run-queue wait seconds so far
    (:func:`runq_wait_s`); reported as ``runq_wait_ms_per_req``.
    """

    def __init__(self, probes: dict[str, Callable[[], float]],
                 waits: dict[str, Callable[[], float]] | None = None) -> None:
        self.probes = probes
        self.waits = waits or {}
        self.marks: dict[str, dict[str, Any]] = {}

    def sample(self) -> dict[str, Any]:
        return {"t": time.monotonic(), "machine": machine_busy(),
                **{k: f() for k, f in self.probes.items()},
                **{"wait:" + k: f() for k, f in self.waits.items()}}

    def mark(self, what: str) -> None:
        self.marks[what] = self.sample()

    def result(self, requests: int) -> dict[str, Any]:
        """cpu_ms_per_req (per probe), machine_busy_pct, other_cpu_pct; {} without both marks."""
        if "start" not in self.marks or "end" not in self.marks or not requests:
            return {}
        a, b = self.marks["start"], self.marks["end"]
        out: dict[str, Any] = {
            "cpu_ms_per_req": {k: round((b[k] - a[k]) * 1000 / requests, 4)
                               for k in self.probes}}
        if self.waits:
            out["runq_wait_ms_per_req"] = {
                k: round((b["wait:" + k] - a["wait:" + k]) * 1000 / requests, 4)
                for k in self.waits}
        busy = b["machine"][0] - a["machine"][0]
        total = b["machine"][1] - a["machine"][1]
        out["machine_busy_pct"] = round(100 * busy / total, 1) if total else None
        # CPU that none of the benchmark's processes used: other work on the machine (it makes a
        # cell noisy; see "other CPU %" in the reports).
        ours = sum(b[k] - a[k] for k in self.probes)
        other = busy / CLK_TCK - ours
        out["other_cpu_pct"] = round(100 * max(other, 0.0) / (total / CLK_TCK), 1) \
            if total else None
        return out


# ---------------------------------------------------------------------------------------------
# mmguard as a child process
# ---------------------------------------------------------------------------------------------


def shut_down(stop: Callable[[], None], tmp: Path, keep_tmp: bool) -> None:
    """The end of a bench run, however it ended: every process stopped (a second Ctrl-C must
    not interrupt that), then the temp dir removed unless it is to be kept."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        stop()
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if keep_tmp:
        print(f"kept {tmp}", file=sys.stderr)
    else:
        shutil.rmtree(tmp, ignore_errors=True)


def stop_each(parts: Sequence[tuple[str, Callable[[], object] | None]]) -> None:
    """Stop every part that is there, in order; one that fails is named and the rest still
    stop."""
    for what, fn in parts:
        if not fn:
            continue
        try:
            fn()
        except BaseException as exc:  # keep stopping the others
            print(f"warning: stopping {what} failed: {exc!r}", file=sys.stderr)


class MmguardProcess:
    """``python -m proxy.cli serve --config <root>/mmguard.yaml`` with ports picked here.

    At log level "warning" mmguard does not log the ports it bound (that line is info), so free
    ports are picked here and passed on the command line (retried on a clash). Ready when
    ``GET /v2/health/ready`` on the HTTP port is 200 (every route's contract is known).
    """

    def __init__(self, root: Path, config: dict[str, Any],
                 extra_args: Sequence[str] = ()) -> None:
        self.root = root
        self.config = config
        self.extra_args = list(extra_args)
        """More ``serve`` arguments (e.g. ``--workers 2``)."""
        self.config_path = root / "mmguard.yaml"
        self.log_path = root / "mmguard.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.ports: dict[str, int] = {}
        # JSON is YAML: no yaml dependency needed here.
        self.config_path.write_text(json.dumps(self.config, indent=2) + "\n")

    def start(self, attempts: int = 3, timeout: float = 90.0) -> None:
        for attempt in range(1, attempts + 1):
            http, grpc_, admin = free_ports(3)
            self.ports = {"http": http, "grpc": grpc_, "admin": admin}
            log = open(self.log_path, "ab")  # noqa: SIM115 - closed below, the child keeps it
            try:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "proxy.cli", "serve", "--config", str(self.config_path),
                     "--http-port", str(http), "--grpc-port", str(grpc_),
                     "--admin-port", str(admin), *self.extra_args],
                    cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True,
                    preexec_fn=pdeathsig)
            finally:
                log.close()
            if self._wait_ready(time.monotonic() + timeout):
                return
            tail = self.log_path.read_text(errors="replace")[-3000:]
            self.stop()
            if "address already in use" in tail.lower() and attempt < attempts:
                continue
            raise RuntimeError(f"mmguard {' '.join(self.extra_args)} did not become ready; "
                               f"log tail:\n{tail}")

    def _wait_ready(self, deadline: float) -> bool:
        """Ready when ``GET /v2/health/ready`` answers 200 (every route's contract known)."""
        assert self.proc is not None
        url = f"http://127.0.0.1:{self.ports['http']}/v2/health/ready"
        while time.monotonic() < deadline and self.proc.poll() is None:
            if http_status(url) == 200:
                return True
            time.sleep(0.1)
        return False

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def stop(self) -> None:
        stop_process(self.proc, signal.SIGTERM, timeout=15)
        self.proc = None


# ---------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------


def fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def render_table(head: list[str], body: list[list[str]], md: bool) -> str:
    """Markdown (first column left, the rest right-aligned) or aligned plain text."""
    if md:
        lines = ["| " + " | ".join(head) + " |",
                 "|" + "|".join("---" if i == 0 else "---:" for i in range(len(head))) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in body]
        return "\n".join(lines)
    widths = [max([len(h), *(len(r[i]) for r in body)]) for i, h in enumerate(head)]

    def fmt_row(r: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(r, widths, strict=True)))

    return "\n".join([fmt_row(head), "  ".join("-" * w for w in widths),
                      *(fmt_row(r) for r in body)])


def report_problems(cells: list[dict[str, Any]], results_md: str,
                    cell_line: Callable[[dict[str, Any]], str]) -> int:
    """Warn about noisy cells; list failed ones on stderr. Returns the exit code (1: failures)."""
    noisy = [c for c in cells if (c.get("other_cpu_pct") or 0) > NOISY_OTHER_PCT]
    if noisy:
        print(f"warning: in {len(noisy)} of {len(cells)} cells more than "
              f"{NOISY_OTHER_PCT}% of the machine's CPU went to processes outside the "
              f"benchmark (other CPU %, {results_md}): those numbers are noisy")
    failed = [c for c in cells if "failed" in c or c.get("errors")]
    if failed:
        print(f"\n{len(failed)} cell(s) with errors or failures:", file=sys.stderr)
        for c in failed:
            print("  " + cell_line(c) + f"  {c.get('error_samples', '')}", file=sys.stderr)
        return 1
    return 0
