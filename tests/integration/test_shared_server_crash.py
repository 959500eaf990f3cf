"""The suite's own guard against a shared server's crash, run as a pytest session of its own
with the suite's conftest as its plugin and a real Triton: a test under which the shared
Triton crashes (SIGSEGV, as Triton 2.51 does) runs once more on the restarted server and
passes; a plain failure, or a test's own SIGKILL of the server, is not run again and fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_CONFTEST = '''
import pytest
from proxy.cli.demo_model import ensure_clip_demo
from tests import conftest as suite
from tests.support.triton import TritonServer, write_model_repository


@pytest.fixture(scope="session")
def triton(tmp_path_factory):  # the suite's shared Triton, with one model: quick to restart
    root = tmp_path_factory.mktemp("triton")
    repo = write_model_repository(root / "repo", ensure_clip_demo(root / "onnx"))
    with TritonServer(repo, root / "work", load_models=["small_fp32"], stop_timeout=2) as t:
        suite._SESSION_TRITON.append(t)
        yield t
        suite._SESSION_TRITON.clear()
'''

_TESTS = '''
import os
import signal
from pathlib import Path


def _kill(triton, sig):
    os.kill(triton.pid, sig)
    triton.process.wait(30)


def test_a_crash_under_it(triton):
    mark = Path(os.environ["CRASH_MARK"])
    if not mark.exists():
        mark.write_text("first try")
        _kill(triton, signal.SIGSEGV)
    assert triton.model_ready("small_fp32"), "the server is gone"


def test_b_plain_failure(triton):
    assert not triton.model_ready("small_fp32"), "a plain failure"


def test_c_killed_by_the_test(triton):
    _kill(triton, signal.SIGKILL)
    assert triton.model_ready("small_fp32"), "killed by the test itself"


def test_d_after_the_kill(triton):
    assert triton.model_ready("small_fp32")
'''


def test_a_test_that_a_shared_server_crash_fails_runs_once_more(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(_CONFTEST)
    (tmp_path / "test_inner.py").write_text(_TESTS)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CRASH_MARK": str(tmp_path / "mark")}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
         "-rA", "test_inner.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "2 failed, 2 passed" in out, out
    for line in ("PASSED test_inner.py::test_a_crash_under_it",
                 "FAILED test_inner.py::test_b_plain_failure",
                 "FAILED test_inner.py::test_c_killed_by_the_test",
                 "PASSED test_inner.py::test_d_after_the_kill"):
        assert line in out, out
    # the rerun is said, with the crash, the first try's failure and its server's restart
    assert "RERUN test_inner.py::test_a_crash_under_it: TritonServer pid" in out, out
    assert "(SIGSEGV) crashed while it ran; its first try failed (call)" in out, out
    assert "the server is gone" in out, out
    assert "ended (killed by SIGSEGV)" in out and "ended (killed by SIGKILL)" in out, out
    # neither the plain failure nor the test's own kill was run again
    assert "RERUN test_inner.py::test_b" not in out and "RERUN test_inner.py::test_c" not in out
    assert (tmp_path / "mark").read_text() == "first try"
