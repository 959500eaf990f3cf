"""The harness itself, on a refusal that must be instant: a timeout header that is not a finite
positive number (``nan`` compares false with everything, ``inf`` never expires)."""

from __future__ import annotations

import json

import pytest

from tests.support.adversary import PROBE_BODY, PROBE_PATH, Prober, http_call, rss_mib
from tests.support.process import MmguardProcess


@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf", "0", "-5", "1e400", "abc"])
def test_timeout_header_must_be_finite_and_positive(served: MmguardProcess, value: str) -> None:
    before = rss_mib(served.proc.pid)
    with Prober(served.ports["http"]) as probes:
        status, headers, body = http_call(served.ports["http"], "POST", PROBE_PATH, PROBE_BODY,
                                          {"mmguard-timeout-ms": value})
        http_call(served.ports["http"], "GET", "/v2/health/ready")
    assert status == 400
    message = json.loads(body)["error"]
    assert "mmguard-timeout-ms" in message and repr(value) in message
    assert headers["mmguard-error-origin"] == "mmguard"
    probes.assert_served(minimum=1)
    assert rss_mib(served.proc.pid) - before < 50


def test_a_finite_timeout_is_kept(served: MmguardProcess) -> None:
    status, _, body = http_call(served.ports["http"], "POST", PROBE_PATH, PROBE_BODY,
                                {"mmguard-timeout-ms": "5000"})
    assert status == 200 and json.loads(body)["outputs"][0]["data"] == [1.0, 2.0]
