"""Connection caps that fit the descriptor table (issue 26 item 2): with the common hard limit
of 1024 open files, 1100 slow connections once exhausted the table before the caps (1000 HTTP
+ 1000 gRPC + 64 admin) were reached, and good requests were reset at accept. Now the caps are
derived from ``RLIMIT_NOFILE``: a new connection is always accepted and takes the place of a
slow one, and the probes are served throughout.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.config.listeners import Listeners
from proxy.process.descriptors import connection_caps
from tests.conftest import ort_config
from tests.support.adversary import Prober, serve
from tests.support.process import MmguardProcess

NOFILE = 1024
SLOW = 1100


@pytest.fixture(scope="module")
def limited(ort_models: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[MmguardProcess]:
    with serve(tmp_path_factory.mktemp("nofile"), ort_config(ort_models), nofile=NOFILE) as proc:
        yield proc


def test_the_default_caps_fit_a_1024_descriptor_limit() -> None:
    caps = connection_caps(Listeners(), nofile=NOFILE)
    assert (caps.http, caps.grpc, caps.admin) == (360, 360, 48)
    assert caps.http + caps.grpc + caps.admin <= NOFILE - 256
    roomy = connection_caps(Listeners(), nofile=1 << 20)
    assert (roomy.http, roomy.grpc, roomy.admin) == (1000, 1000, 64)
    set_by_hand = connection_caps(Listeners.model_validate({"http": {"max_connections": 5}}),
                                  nofile=NOFILE)
    assert set_by_hand.http == 5


def test_1100_slow_connections_under_a_1024_limit_never_reset_a_good_request(
        limited: MmguardProcess) -> None:
    port = limited.ports["http"]
    log = limited.log_path.read_text()
    assert "connection caps: http 360, grpc 360, admin 48 (open-files limit 1024)" in log, log
    held: list[socket.socket] = []
    done = threading.Event()

    def drip() -> None:
        try:
            for _ in range(SLOW):  # each sends half a request line and then nothing
                s = socket.create_connection(("127.0.0.1", port), timeout=10)
                s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n")
                held.append(s)
                time.sleep(0.002)  # leaves the probe thread of this process its share of the GIL
        finally:
            done.set()

    with Prober(port) as probes:
        attacker = threading.Thread(target=drip, daemon=True)
        attacker.start()
        done.wait(120)
        fds = len(os.listdir(f"/proc/{limited.proc.pid}/fd"))
        time.sleep(1.0)  # probes after the last slow connection too
    try:
        assert len(held) == SLOW
        probes.assert_served()
        assert fds < NOFILE, fds
        after = limited.log_path.read_text()
        assert "Too many open files" not in after and "EMFILE" not in after
    finally:
        for s in held:
            s.close()
