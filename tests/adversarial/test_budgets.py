"""Amplifiers without a budget (issue 26 item 2), each against a real ``mmguard serve`` with the
probe client: every probe answered within 1 s, and the process's RSS bounded.

- With shared memory off (the default), a 57 MiB JSON body posted to
  ``/v2/systemsharedmemory/region/x/register`` was parsed on the event loop before the 501
  (+384 MB, a 1.48 s stall): now it is refused before its body is read; with shared memory on a
  registration reads at most 64 KiB. The siblings: the CUDA register endpoint, the repository
  endpoints (off by default), the admin API.
- With shared memory on, a 256 MiB region named as 4 inputs in a ~600-byte request was read
  before the model was looked up, also for a model that does not exist, past
  ``max_request_bytes`` (+1010 MiB, a 1.67 s stall): now no region is read for an unknown model,
  and the bytes to read count against the listener's limit.
- A reload with ``/dev/zero`` as ``secret_file`` or ``cert_file`` grew the process by up to
  2.9 GB before a 409 with an empty reason: now the file is refused, with the reason, before a
  byte is read; so are a FIFO and a 2 GiB file.
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tritonclient.grpc as grpcclient
import yaml
from tritonclient.utils import InferenceServerException

from tests.adversarial.test_images import PeakRss
from tests.conftest import ort_config
from tests.support.adversary import Prober, http_call, rss_mib, serve
from tests.support.process import MmguardProcess

MiB = 1 << 20
BIG_JSON = 57 * MiB
LIMIT = 8 * MiB


def declared_post(port: int, path: str, declared: int, send: int,
                  headers: str = "") -> tuple[int, bytes]:
    """A POST that declares ``declared`` bytes of JSON body and sends the first ``send`` of
    them, then reads the answer: a server that answers before reading the body answers now."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {declared}\r\n{headers}\r\n".encode())
        try:
            s.sendall(b'{"key": "' + b"a" * max(0, send - 10))
        except OSError:
            pass  # the server answered and closed: what we read next says why
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = s.recv(65536)
            if not chunk:
                break
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def chunked_post(port: int, path: str, total: int) -> tuple[int, bytes]:
    """A chunked POST of ``total`` bytes of JSON (no length declared), sent while the server
    may already be answering."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  "Transfer-Encoding: chunked\r\n\r\n".encode())
        piece = b"a" * MiB
        try:
            s.sendall(b'3\r\n{"k\r\n')
            for _ in range(total // MiB):
                s.sendall(b"%x\r\n" % len(piece) + piece + b"\r\n")
            s.sendall(b"0\r\n\r\n")
        except OSError:
            pass
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = s.recv(65536)
            if not chunk:
                break
            answer += chunk
    return int(answer.split(b" ", 2)[1]), answer.partition(b"\r\n\r\n")[2]


# --- shared memory off: the default config --------------------------------------------------


@pytest.mark.parametrize("path", [
    "/v2/systemsharedmemory/region/x/register", "/v2/cudasharedmemory/region/x/register",
    "/v2/repository/index", "/v2/repository/models/identity_fp32/load"])
def test_a_57_mib_body_to_an_endpoint_that_is_off_is_refused_unread(
        served: MmguardProcess, path: str) -> None:
    port = served.ports["http"]
    before = rss_mib(served.proc.pid)
    with Prober(port) as probes, PeakRss(served.proc.pid) as rss:
        status, body = declared_post(port, path, BIG_JSON, 4 * MiB)
        chunked, _ = chunked_post(port, path, 16 * MiB)
        time.sleep(0.3)
    assert status in (403, 501) and chunked == status, (status, body[:300])
    assert json.loads(body)["error"], body
    probes.assert_served(minimum=1)
    assert rss.peak - before < 64, (before, rss.peak)


def test_an_openai_body_is_held_to_the_json_limit(served: MmguardProcess) -> None:
    """A sibling: OpenAI bodies were held to the 64 MiB body limit, and JSON that size holds
    the interpreter lock for seconds however it is parsed; now the 16 MiB JSON limit."""
    status, body = declared_post(served.ports["http"], "/v1/chat/completions", BIG_JSON, MiB)
    assert status == 413, body[:300]
    assert "listeners.http.max_json_bytes" in json.loads(body)["error"]["message"]


def test_the_admin_api_reads_no_body_past_its_limit(served: MmguardProcess) -> None:
    port = served.ports["admin"]
    status, body = declared_post(port, "/admin/experiments", BIG_JSON, MiB)
    assert status == 413, body[:300]


# --- shared memory on: a big region named by a small request ---------------------------------


@pytest.fixture(scope="module")
def shm_limited(ort_models: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[MmguardProcess]:
    config = ort_config(ort_models, shared_memory={"system": True},
                        listeners={"http": {"max_request_bytes": LIMIT}})
    with serve(tmp_path_factory.mktemp("budgets_shm"), config) as proc:
        yield proc


@pytest.fixture
def big_region(shm_limited: MmguardProcess) -> Iterator[str]:
    """A registered 256 MiB region (a sparse file: it costs nothing until read)."""
    key = f"mmg_budget_{os.getpid()}_{secrets.token_hex(3)}"
    path = Path("/dev/shm") / key
    with open(path, "wb") as f:
        f.truncate(256 * MiB)
    port = shm_limited.ports["http"]
    status, _, body = http_call(port, "POST", "/v2/systemsharedmemory/region/big/register",
                                json.dumps({"key": "/" + key, "byte_size": 256 * MiB}).encode())
    assert status == 200, body
    try:
        yield "big"
    finally:
        http_call(port, "POST", "/v2/systemsharedmemory/region/big/unregister")
        path.unlink()


def four_inputs(region: str) -> bytes:
    return json.dumps({"inputs": [
        {"name": f"INPUT{i}", "datatype": "FP32", "shape": [64 * MiB // 1],
         "parameters": {"shared_memory_region": region,
                        "shared_memory_byte_size": 256 * MiB}} for i in range(4)]}).encode()


@pytest.mark.parametrize(("model", "status", "words"), [
    ("no_such_model", 404, "no_such_model"),
    ("identity_fp32", 413, "listeners.http.max_request_bytes"),
])
def test_a_big_region_named_four_times_is_never_read(
        shm_limited: MmguardProcess, big_region: str, model: str, status: int,
        words: str) -> None:
    port = shm_limited.ports["http"]
    body = four_inputs(big_region)
    assert len(body) < 1000
    before = rss_mib(shm_limited.proc.pid)
    with Prober(port) as probes, PeakRss(shm_limited.proc.pid) as rss:
        got, _, answer = http_call(port, "POST", f"/v2/models/{model}/infer", body)
        time.sleep(0.3)
    assert got == status and words in json.loads(answer)["error"], answer
    probes.assert_served(minimum=1)
    assert rss.peak - before < 64, (before, rss.peak)


@pytest.mark.parametrize(("model", "code", "words"), [
    ("no_such_model", "StatusCode.NOT_FOUND", "no_such_model"),
    ("identity_fp32", "StatusCode.RESOURCE_EXHAUSTED", "listeners.grpc.max_request_bytes"),
])
def test_the_same_over_grpc_unary_and_stream(shm_limited: MmguardProcess, big_region: str,
                                             model: str, code: str, words: str) -> None:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{shm_limited.ports['grpc']}")
    inputs = []
    for i in range(4):
        x = grpcclient.InferInput(f"INPUT{i}", [64 * MiB], "FP32")
        x.set_shared_memory(big_region, 256 * MiB)
        inputs.append(x)
    before = rss_mib(shm_limited.proc.pid)
    errors: queue.Queue[Any] = queue.Queue()
    try:
        with Prober(shm_limited.ports["http"]) as probes, \
                PeakRss(shm_limited.proc.pid) as rss:
            with pytest.raises(InferenceServerException) as unary:
                client.infer(model, inputs, client_timeout=30)
            client.start_stream(callback=lambda result, error: errors.put(error or result))
            client.async_stream_infer(model, inputs)
            streamed = errors.get(timeout=30)
            client.stop_stream()
            time.sleep(0.3)
    finally:
        client.close()
    assert unary.value.status() == code and words in unary.value.message(), unary.value
    assert isinstance(streamed, InferenceServerException) and words in streamed.message()
    probes.assert_served(minimum=1)
    assert rss.peak - before < 64, (before, rss.peak)


def test_a_registration_body_is_read_to_64_kib_at_most(shm_limited: MmguardProcess) -> None:
    port = shm_limited.ports["http"]
    before = rss_mib(shm_limited.proc.pid)
    with Prober(port) as probes:
        status, body = declared_post(port, "/v2/systemsharedmemory/region/x/register",
                                     BIG_JSON, MiB)
        chunked, answer = chunked_post(port, "/v2/systemsharedmemory/region/y/register",
                                       16 * MiB)
        time.sleep(0.3)
    assert status == 413 and chunked == 413, (body[:200], answer[:200])
    assert "at most 65536 bytes" in json.loads(body)["error"]
    probes.assert_served(minimum=1)
    assert rss_mib(shm_limited.proc.pid) - before < 64


# --- files a config names ---------------------------------------------------------------------


@pytest.fixture
def reloadable(ort_models: Path, tmp_path: Path) -> Iterator[tuple[MmguardProcess, Path]]:
    with serve(tmp_path, _reload_config(ort_models, {})) as proc:
        yield proc, tmp_path / "mmguard.yaml"


RELOAD_TOKEN = "budget-reload-token"
"""Long enough to be a secret the log is searched for (a one-letter token is in every line)."""


def _reload_config(ort_models: Path, extra: dict[str, Any]) -> dict[str, Any]:
    listeners: dict[str, dict[str, Any]] = {"admin": {"token": RELOAD_TOKEN}}
    for name, block in extra.get("listeners", {}).items():
        listeners[name] = {**listeners.get(name, {}), **block}
    if "token_file" in listeners["admin"]:
        del listeners["admin"]["token"]  # one source (the running token stays RELOAD_TOKEN)
    return ort_config(ort_models, watch_config_s=0, **{**extra, "listeners": listeners})


def _reload(proc: MmguardProcess) -> tuple[int, dict[str, Any]]:
    status, _, body = http_call(proc.ports["admin"], "POST", "/admin/reload",
                                headers={"Authorization": f"Bearer {RELOAD_TOKEN}"}, timeout=60)
    return status, json.loads(body)


def test_a_reload_naming_dev_zero_a_fifo_or_a_huge_file_is_refused_with_the_reason(
        reloadable: tuple[MmguardProcess, Path], ort_models: Path, tmp_path: Path) -> None:
    proc, path = reloadable
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    huge = tmp_path / "huge"
    with open(huge, "wb") as f:
        f.truncate(2 << 30)  # sparse: 2 GiB that cost no disk
    cases: list[tuple[dict[str, Any], str]] = [
        ({"canary": {"secret_file": "/dev/zero"}},
         "/dev/zero is a character device; a regular file is expected"),
        ({"listeners": {"http": {"tls": {"cert_file": "/dev/zero", "key_file": "/dev/zero"}}}},
         "/dev/zero is a character device; a regular file is expected"),
        ({"listeners": {"admin": {"token_file": str(fifo)}}},
         f"{fifo} is a FIFO (named pipe); a regular file is expected"),
        ({"canary": {"secret_file": str(huge)}},
         f"{huge} is {2 << 30} bytes; at most 65536 bytes are read from it"),
        ({"canary": {"secret_file": str(tmp_path)}},
         f"{tmp_path} is a directory; a regular file is expected"),
    ]
    before = rss_mib(proc.proc.pid)
    with Prober(proc.ports["http"]) as probes, PeakRss(proc.proc.pid) as rss:
        for extra, reason in cases:
            path.write_text(yaml.safe_dump(_reload_config(ort_models, extra)))
            status, doc = _reload(proc)
            assert status == 409 and reason in doc["message"], doc
            checked = subprocess.run([sys.executable, "-m", "proxy.cli", "check-config",
                                      str(path)], capture_output=True, text=True, timeout=60)
            assert checked.returncode == 1 and reason in checked.stderr, checked.stderr
    probes.assert_served(minimum=1)
    assert rss.peak - before < 64, (before, rss.peak)
