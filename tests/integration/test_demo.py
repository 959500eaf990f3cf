"""The first five minutes: ``mmguard serve`` with no config runs the guard chain, and
``mmguard demo`` walks through it against that real process, each step printed with the
``mmguard-*`` headers that explain it."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.cli.demo import image, infer_http
from proxy.cli.demo_model import tokenize
from tests.support.process import MmguardProcess


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MmguardProcess]:
    tmp = tmp_path_factory.mktemp("demo")
    import os
    os.environ["MMGUARD_CACHE_DIR"] = str(tmp / "cache")
    try:
        p = MmguardProcess([], tmp / "serve.log")
    finally:
        del os.environ["MMGUARD_CACHE_DIR"]
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{p.ports['http']}/v2/health/ready",
                                            timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the embedded default never became ready"
            time.sleep(0.2)
        yield p
    finally:
        assert p.stop() == 0


def sections(text: str) -> dict[int, str]:
    """The demo's output by step number."""
    parts = re.split(r"^(\d)\. ", text, flags=re.M)
    return {int(parts[i]): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def test_the_demo_walks_through_every_guard(embedded: MmguardProcess) -> None:
    ports = embedded.ports
    demo = subprocess.run([sys.executable, "-m", "proxy.cli", "demo",
                           "--url", f"127.0.0.1:{ports['grpc']}",
                           "--http", f"127.0.0.1:{ports['http']}",
                           "--admin", f"http://127.0.0.1:{ports['admin']}"],
                          capture_output=True, text=True, timeout=120)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    steps = sections(demo.stdout)
    assert sorted(steps) == [1, 2, 3, 4, 5, 6], demo.stdout
    # 1: a clean call, answered, mirrored to the canary route
    assert "similarity (image vs text):" in steps[1]
    assert "-> HTTP 200" in steps[1] and "mmguard-shadow: queued; to 'clip_demo_canary'" \
        in steps[1]
    assert "mmguard-fault" not in steps[1]  # not canary-marked: untouched
    # 2: the over-long text, refused with the counts
    assert "-> HTTP 400" in steps[2]
    assert ("mmguard-shape-tokens: reject; input 'input_ids' has 90 tokens (element 0); "
            "model 'clip_demo' reads 77 and would silently drop 13") in steps[2]
    # 3: the dark image, answered and annotated
    assert "-> HTTP 200" in steps[3]
    assert re.search(r"mmguard-quality-exposure: annotate; .*signal 'exposure'", steps[3])
    # 4: the NaN image, refused
    assert "-> HTTP 422" in steps[4]
    assert re.search(r"mmguard-quality-finite: reject; .*NaN/Inf values", steps[4])
    # 5: canary-marked, the fault experiment says what it did
    assert "-> HTTP 200" in steps[5]
    assert "mmguard-fault: demo-noise/gaussian_noise" in steps[5]
    # 6: mmguard status, which counted all of it
    assert "READY" in steps[6]
    assert re.search(r"clip_demo\s+\d+\s+\d+\s+1\s+1", steps[6]), steps[6]  # 400 + 422
    assert re.search(r"demo-noise\s+clip_demo\s+RUNNING", steps[6])
    assert re.search(r"clip_demo\s+clip_demo_canary\s+\w+\s+\d+\s+100\.0%", steps[6])


def test_untrusted_by_default_still_canary_only(embedded: MmguardProcess) -> None:
    """Without the header the experiment never touches a call: the fault filter's rule that only
    canary traffic is perturbed holds on the embedded default too."""
    http = f"127.0.0.1:{embedded.ports['http']}"
    ids = tokenize("a dog")[None, :]
    plain = infer_http(http, "clip_demo", image("clean", seed=3), ids)
    marked = infer_http(http, "clip_demo", image("clean", seed=3), ids, {"x-canary": "1"})
    assert plain.status == marked.status == 200
    assert "mmguard-fault" not in plain.mmguard
    assert marked.mmguard["mmguard-fault"].startswith("demo-noise/gaussian_noise")


def test_the_embedded_default_listens_on_loopback_only(tmp_path: Path) -> None:
    """It trusts x-canary (so the demo can opt in): that is safe only because no other machine
    can reach it; any config file's listeners trust nothing unless it says so."""
    from proxy.cli.embedded import embedded_config
    from proxy.config.model import parse_config

    cfg = embedded_config(tmp_path / "models")
    assert cfg.listeners.http.host == cfg.listeners.grpc.host == "127.0.0.1"
    assert cfg.listeners.http.trust_canary_headers and cfg.listeners.grpc.trust_canary_headers
    plain = parse_config({"backends": [{"kind": "onnxruntime", "name": "b",
                                        "model_dir": str(tmp_path / "models")}],
                          "models": [{"name": "clip_demo", "backend": "b"}]})
    assert not plain.listeners.http.trust_canary_headers
    assert not plain.listeners.grpc.trust_canary_headers


def test_serve_without_onnx_runtime_says_which_extra_in_one_line(tmp_path: Path) -> None:
    """`pip install mmguard` without the cpu/gpu extra: the embedded default cannot load its
    model, and says so in one line instead of a traceback. (The module is blocked in the child
    process the way a missing one fails: `import onnxruntime` raises ImportError.)"""
    import os

    code = ("import sys; sys.modules['onnxruntime'] = None\n"
            "from proxy.cli.main import main\n"
            "sys.exit(main(['serve', '--http-port', '0', '--grpc-port', '0', "
            "'--admin-port', '0']))")
    env = {**os.environ, "MMGUARD_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if "onnxruntime" in ln.lower()
             or "ONNX Runtime" in ln]
    assert len(lines) == 1, done.stderr
    assert "pip install 'mmguard[cpu]'" in lines[0] and "'gpu' extra" in lines[0]
