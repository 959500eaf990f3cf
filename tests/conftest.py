from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _pytest.runner import runtestprotocol

from proxy.cli.demo_model import ensure_clip_demo
from tests.support.mmguard import RunningMmguard
from tests.support.models import IDENTITY_TYPES, ort_repository
from tests.support.triton import TritonServer, triton_available, write_model_repository
from tests.support.vllm import VllmServer, make_tiny_models, vllm_available


@pytest.fixture(scope="session")
def ort_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ort_repository(tmp_path_factory.mktemp("ort_models"))


def ort_config(model_dir: Path, **extra: object) -> dict[str, Any]:
    identities = [f"identity_{d.lower()}" for d in IDENTITY_TYPES]
    cfg: dict[str, Any] = {  # a config document: callers index into it and extend it
        "backends": [{"kind": "onnxruntime", "name": "ort", "model_dir": str(model_dir),
                      "max_batch_size": {"clip_demo": 8}}],
        "models": [{"name": "clip_demo", "backend": "ort"},
                   *({"name": n, "backend": "ort"} for n in identities)],
    }
    cfg.update(extra)
    return cfg


@pytest.fixture(scope="module")
def ort_proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningMmguard]:
    models = ort_repository(tmp_path_factory.mktemp("ort_proxy_models"))
    with RunningMmguard(ort_config(models)) as m:
        m.wait_ready()
        yield m


@pytest.fixture(scope="session")
def triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    """One real Triton for the session. Missing binary = a loud failure, never a skip."""
    ok, why = triton_available()
    if not ok:
        pytest.fail(f"real Triton is required for this test and cannot run here: {why}")
    root = tmp_path_factory.mktemp("triton")
    onnx_path = ensure_clip_demo(root / "onnx")
    repo = write_model_repository(root / "repo", onnx_path)
    with TritonServer(repo, root / "work") as server:
        for failure in server.start_failures:
            _SERVER_REPORTS.append(f"SHARED TRITON START RETRIED ({server.log_path}): {failure}")
        _SESSION_TRITON.append(server)
        yield server
        _SESSION_TRITON.clear()


_SESSION_TRITON: list[TritonServer] = []
_SERVER_REPORTS: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def _shared_triton_answers() -> None:
    """Before each module: the shared Triton (once started) must answer. A Triton that stopped
    answering is restarted, and the terminal summary says so with its log: one wedged test
    dependency must not fail every later module, nor go unnoticed."""
    if _SESSION_TRITON:
        why = _SESSION_TRITON[0].ensure_healthy()
        if why is not None:
            _SERVER_REPORTS.insert(0, f"SHARED TRITON RESTARTED: {why}")


@pytest.fixture(autouse=True)
def _shared_triton_runs() -> None:
    """Before each test: a shared Triton whose process ended is started again at once (same
    ports, the log appended to), and the summary says so. Triton 2.51's gRPC frontend can
    crash (SIGSEGV) when a client's cancellation races the answer it cancels
    (triton-inference-server/server#7368, fixed in 24.12); tests that cancel calls on the
    shared server must not leave every later test of their module without one."""
    if _SESSION_TRITON:
        why = _SESSION_TRITON[0].restart_if_ended()
        if why is not None:
            _SERVER_REPORTS.insert(0, f"SHARED TRITON RESTARTED: {why}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """When a test that uses the shared Triton fails, keep what Triton logged at that moment."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.failed and "triton" in getattr(item, "fixturenames", ()) and _SESSION_TRITON:
        server = _SESSION_TRITON[0]
        _SERVER_REPORTS.append(f"{item.nodeid} ({report.when}): triton running="
                               f"{server.is_running()}\n{server.log_tail(15)}")


# A server that ends by one of these crashed; a test's own kill() or stop() sends KILL or TERM.
_CRASH_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGILL,
                            signal.SIGFPE})


def _crashed_shared_server() -> str | None:
    """A session server (Triton, vLLM) whose process ended by a crash signal, by name."""
    servers: list[TritonServer | VllmServer] = [*_SESSION_TRITON, *_SESSION_VLLM]
    for server in servers:
        proc = server.process
        code = proc.poll() if proc is not None else None
        if proc is not None and code is not None and code < 0 and -code in _CRASH_SIGNALS:
            return f"{type(server).__name__} pid {proc.pid} ({signal.Signals(-code).name})"
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool:
    """A test that fails while a shared server crashes under it is run once more, on the
    restarted server, and the summary names both (the test, the crash with its trace). Triton
    2.51 can SIGSEGV under load (seen in CI twice: mid fault matrix, mid sequence test, direct
    calls included), and one upstream crash must not decide a run. A test that fails again, or
    fails without a crash, fails as it is; a test's own KILL or TERM of a server is no crash.
    The rerun's setup restarts the server (``_shared_triton_runs``, ``_shared_vllm_runs``)."""
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    reports = runtestprotocol(item, nextitem=nextitem, log=False)
    crashed = _crashed_shared_server() if any(r.failed for r in reports) else None
    if crashed is not None:
        first = next(r for r in reports if r.failed)
        crash = getattr(first.longrepr, "reprcrash", None)
        why = crash.message if crash is not None else str(first.longrepr).splitlines()[-1]
        _SERVER_REPORTS.insert(0, f"RERUN {item.nodeid}: {crashed} crashed while it ran; its "
                                  f"first try failed ({first.when}): {why[:300]}")
        reports = runtestprotocol(item, nextitem=nextitem, log=False)
    for report in reports:
        item.ihook.pytest_runtest_logreport(report=report)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for text in _SERVER_REPORTS[:4]:  # the first failures tell the story; the rest repeat it
        terminalreporter.write_sep("-", "shared servers: a restart or a failure")
        terminalreporter.write_line(text)


def triton_routes(triton: TritonServer, models: list[str]) -> dict[str, Any]:
    """Every model twice: ``g_<m>`` through the gRPC backend, ``h_<m>`` through HTTP."""
    return {
        "backends": [{"kind": "triton_grpc", "name": "triton-grpc", "url": triton.grpc_url},
                     {"kind": "triton_http", "name": "triton-http", "url": triton.http_url}],
        "models": [*({"name": f"g_{m}", "backend": "triton-grpc", "backend_model": m}
                     for m in models),
                   *({"name": f"h_{m}", "backend": "triton-http", "backend_model": m}
                     for m in models)],
    }


@pytest.fixture(scope="session")
def vllm_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    ok, why = vllm_available()
    if not ok:
        pytest.fail(f"real vLLM is required for this test and cannot run here: {why}")
    return make_tiny_models(tmp_path_factory.mktemp("vllm_models"))


def start_vllm(models: dict[str, Path], name: str, tmp: Path,
               extra_args: tuple[str, ...] = ()) -> Iterator[VllmServer]:
    server = VllmServer(models[name], name, log_path=tmp / f"{name}.log", extra_args=extra_args)
    try:
        server.start()
        _SESSION_VLLM.append(server)
        yield server
    finally:
        _SESSION_VLLM.remove(server)
        server.stop()


_SESSION_VLLM: list[VllmServer] = []


@pytest.fixture(autouse=True)
def _shared_vllm_runs() -> None:
    """Before each test: a session's vLLM whose process ended on its own is started again on
    its port, and the summary says so with its log; one crash must not fail every later test
    that shares the server."""
    for server in _SESSION_VLLM:
        why = server.restart_if_ended()
        if why is not None:
            _SERVER_REPORTS.insert(0, f"SHARED vLLM RESTARTED: {why}")


@pytest.fixture(scope="session")
def vllm_llama(vllm_models: dict[str, Path],
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """tiny-llama (text only, max_model_len 128), started once per session."""
    yield from start_vllm(vllm_models, "tiny-llama", tmp_path_factory.mktemp("vllm_llama"))


@pytest.fixture(scope="session")
def vllm_llava(vllm_models: dict[str, Path],
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """tiny-llava (text + up to 2 images, 4 tokens each), started once per session; it also
    serves /tokenizer_info (off by default in vLLM), and runs without prefix caching, so a
    repeated request is computed as the first one was (a cached prefix may change the low bits
    of the logits: enough to flip a near-tie of this random model's greedy choice)."""
    yield from start_vllm(vllm_models, "tiny-llava", tmp_path_factory.mktemp("vllm_llava"),
                          ("--enable-tokenizer-info-endpoint", "--no-enable-prefix-caching"))


@pytest.fixture(scope="session")
def vllm_llama_long(vllm_models: dict[str, Path],
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """The same tiny-llama with a longer context (256), served as tiny-llama-long."""
    server = VllmServer(vllm_models["tiny-llama"], "tiny-llama-long", max_model_len=256,
                        log_path=tmp_path_factory.mktemp("vllm_long") / "long.log")
    try:
        server.start()
        yield server
    finally:
        server.stop()
