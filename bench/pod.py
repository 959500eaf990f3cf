"""A pod's control state: how fast a decision reaches every worker, and what the supervisor costs.

    python -m bench.pod [--workers 2] [--trials 30] [--seconds 5]

Starts ``mmguard serve --workers N`` on an in-process ONNX Runtime identity model (the route has
``fallback`` and ``fault``: a breaker and an experiment registry in the pod's control state) and
keeps 4 × N keep-alive HTTP connections open (the kernel spreads them over the workers).

* **propagation**: the admin API forces the breaker open (then resets it); the time from the
  admin answer to the moment *every* connection has seen the new state (its calls refused, then
  served again), p50 and max over ``--trials``. The figure includes one request's round trip.
* **supervisor cost**: ``--seconds`` of load on all connections; CPU seconds of the supervisor
  and of the workers per 1,000 requests (from /proc), i.e. what forwarding every outcome to one
  place costs next to serving.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import ROOT, free_ports, proc_cpu_s

BODY = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [4],
                               "data": [1.0, 2.0, 3.0, 4.0]}]}).encode()


def _config(model_dir: Path, workers: int) -> str:
    import yaml
    return yaml.safe_dump({
        "workers": workers,
        "listeners": {"admin": {"token": "bench"}},
        "canary": {"share": 1.0},
        "backends": [{"kind": "onnxruntime", "name": "ort", "model_dir": str(model_dir),
                      "models": ["identity_fp32"], "threads": 1}],
        "models": [{"name": "identity_fp32", "backend": "ort", "filters": [
            {"limits": {"max_in_flight": 1024}},
            {"fallback": {"breaker": {"minimum_calls": 1000, "wait_in_open_s": 300},
                          "cache": None}},
            {"fault": {}}]}]})


def _admin(port: int, path: str) -> None:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("POST", path, headers={"Authorization": "Bearer bench"})
    r = c.getresponse()
    r.read()
    assert r.status == 200, (path, r.status)
    c.close()


def _call(c: http.client.HTTPConnection) -> int:
    c.request("POST", "/v2/models/identity_fp32/infer", body=BODY,
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    r.read()
    return r.status


def _until_all(conns: list[http.client.HTTPConnection], want: int) -> float:
    """Every connection polls at once (a thread each); when, after now, the last one's first
    changed answer was *sent*: the change was in that worker by then plus one round trip."""
    start = time.perf_counter()
    firsts: list[float] = []

    def poll(c: http.client.HTTPConnection) -> None:
        while time.perf_counter() - start < 10:
            sent = time.perf_counter()
            if _call(c) == want:
                firsts.append(sent - start)
                return

    threads = [threading.Thread(target=poll, args=(c,)) for c in conns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if len(firsts) < len(conns):
        raise RuntimeError(f"{len(conns) - len(firsts)} connections never saw status {want}")
    return max(firsts)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.pod", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--trials", type=int, default=30)
    p.add_argument("--seconds", type=float, default=5.0)
    args = p.parse_args()
    from tests.support.models import write_identity

    tmp = Path(tempfile.mkdtemp(prefix="bench-pod-"))
    write_identity(tmp / "models", "FP32")
    (tmp / "mmguard.yaml").write_text(_config(tmp / "models", args.workers))
    http_port, grpc_port, admin_port = free_ports(3)
    log = open(tmp / "mmguard.log", "w")  # noqa: SIM115 - closed at the end
    proc = subprocess.Popen([sys.executable, "-m", "proxy.cli", "serve", "--config",
                             str(tmp / "mmguard.yaml"), "--http-port", str(http_port),
                             "--grpc-port", str(grpc_port), "--admin-port", str(admin_port)],
                            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                c = http.client.HTTPConnection("127.0.0.1", admin_port, timeout=2)
                c.request("GET", "/readyz")
                if c.getresponse().status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                print((tmp / "mmguard.log").read_text()[-3000:])
                return 1
            time.sleep(0.2)
        conns = [http.client.HTTPConnection("127.0.0.1", http_port, timeout=10)
                 for _ in range(4 * args.workers)]
        for c in conns:
            assert _call(c) == 200
        opened, closed = [], []
        for _ in range(args.trials):
            _admin(admin_port, "/admin/breakers/identity_fp32/identity_fp32/open")
            opened.append(_until_all(conns, 503))
            _admin(admin_port, "/admin/breakers/identity_fp32/identity_fp32/reset")
            closed.append(_until_all(conns, 200))
        ms = [x * 1000 for x in opened + closed]
        print(f"workers {args.workers}, {len(conns)} connections: a breaker forced open / reset "
              f"reached every connection in p50 {statistics.median(ms):.2f} ms, max "
              f"{max(ms):.2f} ms ({len(ms)} changes; the send time of the last connection's first "
              f"changed answer)")

        workers = _children(proc.pid)
        before = {pid: proc_cpu_s(pid) for pid in [proc.pid, *workers]}
        count = [0]
        stop = time.monotonic() + args.seconds

        def load(c: http.client.HTTPConnection) -> None:
            while time.monotonic() < stop:
                assert _call(c) == 200
                count[0] += 1

        threads = [threading.Thread(target=load, args=(c,)) for c in conns]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        after = {pid: proc_cpu_s(pid) for pid in before}
        sup = after[proc.pid] - before[proc.pid]
        work = sum(after[w] - before[w] for w in workers)
        n = count[0]
        print(f"load: {n} requests in {args.seconds:g} s; CPU per 1,000 requests: supervisor "
              f"{sup / n * 1000 * 1000:.1f} ms, workers {work / n * 1000 * 1000:.1f} ms "
              f"(supervisor = {sup / max(work, 1e-9):.1%} of the workers)")
        print("(mmguard's log: " + str(tmp / "mmguard.log") + ")")
        return 0
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


if __name__ == "__main__":
    sys.exit(main())
