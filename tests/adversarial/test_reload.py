"""A 15 MiB config reloaded while clients are served: reading, validating and building the new
runtime run in a thread, so the data plane keeps answering (it stalled 19 s when they ran on the
event loop)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from tests.conftest import ort_config
from tests.support.adversary import Prober, serve, write_config
from tests.support.process import MmguardProcess

BIG_BYTES = 15 * 1024 * 1024


def _log_count(proc: MmguardProcess, text: str) -> int:
    return sum(text in str(rec.get("msg", "")) for rec in proc.records())


def _wait_count(proc: MmguardProcess, text: str, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while _log_count(proc, text) < count:
        assert time.monotonic() < deadline, (f"no {count} log lines with {text!r}:\n"
                                             + proc.log_path.read_text()[-3000:])
        time.sleep(0.1)


def _big_config(ort_models: Path) -> dict[str, object]:
    """A valid config of about 15 MiB: clip_demo's fallback carries a large static answer."""
    values = [round(i * 1e-6, 6) for i in range(BIG_BYTES // 18)]  # ~18 bytes each
    cfg = ort_config(ort_models, watch_config_s=0)  # SIGHUP only: one reload
    models = list(cfg["models"])
    models[0] = {"name": "clip_demo", "backend": "ort", "filters": [{"fallback": {
        "static_answer": [{"name": "embedding", "datatype": "FP32", "shape": [len(values)],
                           "data": values}]}}]}
    cfg["models"] = models
    return cfg


def test_a_15_mib_config_reloads_while_every_probe_is_served(tmp_path: Path,
                                                              ort_models: Path) -> None:
    with serve(tmp_path, ort_config(ort_models, watch_config_s=0)) as proc:
        path = write_config(tmp_path / "mmguard.yaml", _big_config(ort_models))
        size = path.stat().st_size
        assert 14 * 2**20 < size < 17 * 2**20, size
        with Prober(proc.ports["http"]) as probes:
            time.sleep(0.5)
            started = time.monotonic()
            proc.signal(signal.SIGHUP)
            _wait_count(proc, "config reloaded from", 1, timeout=240)
            took = time.monotonic() - started
            time.sleep(0.5)
        assert _log_count(proc, "config reload rejected") == 0
        worst = max(r.waited for r in probes.records)
        print(f"reload of {size / 2**20:.1f} MiB took {took:.1f} s; the slowest of "
              f"{len(probes.records)} probes waited {worst:.2f} s")
        probes.assert_served(minimum=5)
