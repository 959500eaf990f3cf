"""The shadow mirroring 100 % of calls, traced with an in-memory exporter: every request's
trace holds that request only (the same span count for each), and every mirrored copy runs in
a trace of its own whose root links to the request that caused it. Before, the workers started
inside the first request's context and that one trace swallowed every later copy."""

from __future__ import annotations

import json
import time
import urllib.request
from collections import defaultdict
from collections.abc import Iterator

import numpy as np
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan

from tests.integration.test_signals import span_exporter
from tests.support.fake_v2 import FakeV2
from tests.support.mmguard import RunningMmguard
from tests.support.wire import grpc_infer_raw, grpc_request

REQUESTS = 12
X = np.array([1.5, -2.0], "<f4")


@pytest.fixture(scope="module")
def proxy() -> Iterator[RunningMmguard]:
    with FakeV2() as fake:
        cfg = {"backends": [{"kind": "triton_grpc", "name": "g",
                             "url": f"127.0.0.1:{fake.grpc_port}"}],
               "models": [{"name": "prod", "backend": "g", "backend_model": "echo",
                           "filters": [{"shadow": {"canary": "canary", "percent": 100,
                                                   "workers": 2}}]},
                          {"name": "canary", "backend": "g", "backend_model": "echo"}]}
        with RunningMmguard(cfg) as m:
            m.wait_ready()
            yield m


def _compared(m: RunningMmguard) -> int:
    with urllib.request.urlopen(m.admin_url + "/admin/shadows", timeout=5) as r:
        return int(json.loads(r.read())["prod"]["compared"])


def test_each_mirrored_copy_has_its_own_trace_linked_to_its_request(
        proxy: RunningMmguard) -> None:
    exporter = span_exporter()
    for i in range(REQUESTS):  # distinct requests: a replay is mirrored once per verdict
        grpc_infer_raw(proxy.grpc_url, grpc_request("prod", [("INPUT0", "FP32", [2],
                                                               (X + i).tobytes())]))
    deadline = time.monotonic() + 30
    while _compared(proxy) < REQUESTS and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _compared(proxy) == REQUESTS
    time.sleep(0.2)  # the last copy's span ends just after its comparison is counted
    by_trace: dict[int, list[ReadableSpan]] = defaultdict(list)
    spans = exporter.get_finished_spans()
    for s in spans:
        assert s.context is not None
        by_trace[s.context.trace_id].append(s)
    requests = {t: ss for t, ss in by_trace.items()
                if any(s.kind == trace.SpanKind.SERVER for s in ss)}
    copies = {t: ss for t, ss in by_trace.items() if t not in requests}
    assert len(requests) == REQUESTS and len(copies) == REQUESTS, \
        {t: [s.name for s in ss] for t, ss in by_trace.items()}
    # every request's trace is the same size: no trace holds another request's copy
    sizes = {len(ss) for ss in requests.values()}
    assert len(sizes) == 1, sizes
    caused: set[int] = set()
    for ss in copies.values():
        roots = [s for s in ss if s.parent is None]
        assert [r.name for r in roots] == ["shadow copy prod -> canary"]
        links = roots[0].links
        assert len(links) == 1 and links[0].context.trace_id in requests
        caused.add(links[0].context.trace_id)
        assert any(s.kind == trace.SpanKind.CLIENT for s in ss)  # the copy's backend hop
    assert len(caused) == REQUESTS  # one copy per request, each linked to its own
