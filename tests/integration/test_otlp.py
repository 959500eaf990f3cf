"""OTLP export end to end: mmguard as a real process exports its spans over OTLP/gRPC to a
real OTLP receiver (the collector's TraceService, served here on a local port): the request
span continues the client's trace, each filter has its span, and a decision is a span event."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import yaml
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tpb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tgrpc

from tests.conftest import ort_config
from tests.support.process import MmguardProcess
from tests.support.wire import grpc_infer_raw, grpc_request

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
SERVER_SPAN = "inference.GRPCInferenceService/ModelInfer"  # OpenTelemetry RPC span name


class Receiver(tgrpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[Any] = []
        self.lock = threading.Lock()

    def Export(self, request: tpb.ExportTraceServiceRequest,  # the proto names it Export
               context: Any) -> tpb.ExportTraceServiceResponse:
        with self.lock:
            for rs in request.resource_spans:
                for ss in rs.scope_spans:
                    self.spans.extend(ss.spans)
        return tpb.ExportTraceServiceResponse()


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, int]]:
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(2))
    rec = Receiver()
    tgrpc.add_TraceServiceServicer_to_server(rec, server)  # type: ignore[no-untyped-call]  # generated
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield rec, port
    server.stop(0)


def test_spans_reach_a_real_otlp_receiver(receiver: tuple[Receiver, int], ort_models: Path,
                                          tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    rec, port = receiver
    cfg = ort_config(ort_models)
    cfg["models"] = [{"name": "idf", "backend": "ort", "backend_model": "identity_fp32",
                      "filters": [{"limits": {"max_batch": 4}}]}]
    cfg["telemetry"] = {"otlp_endpoint": f"http://127.0.0.1:{port}",
                        "service_name": "mmguard-test"}
    path = tmp_path / "mmguard.yaml"
    path.write_text(yaml.safe_dump(cfg))
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export every 100 ms, not 5 s
    proc = MmguardProcess(["--config", str(path)], tmp_path / "mmguard.log")
    try:
        url = f"127.0.0.1:{proc.ports['grpc']}"
        parent = (("traceparent", f"00-{TRACE_ID}-00f067aa0ba902b7-01"),)
        ok = grpc_request("idf", [("INPUT0", "FP32", [3], np.ones(3, "<f4").tobytes())])
        deadline = time.monotonic() + 60
        while True:  # the backend may still be loading its model
            try:
                grpc_infer_raw(url, ok, metadata=parent)
                break
            except grpc.RpcError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        big = grpc_request("idf", [("INPUT0", "FP32", [9], np.ones(9, "<f4").tobytes())])
        with pytest.raises(grpc.RpcError):  # shape [9]: a batch of 9 over limits.max_batch 4
            grpc_infer_raw(url, big, metadata=parent)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with rec.lock:
                names = [s.name for s in rec.spans]
            if names.count("filter limits") >= 2 and names.count(SERVER_SPAN) >= 2:
                break
            time.sleep(0.1)
    finally:
        proc.stop()
    with rec.lock:
        spans = list(rec.spans)
    ours = [s for s in spans if s.trace_id.hex() == TRACE_ID]
    servers = [s for s in ours if s.name == SERVER_SPAN]
    filters = [s for s in ours if s.name == "filter limits"]
    assert len(servers) >= 2 and len(filters) >= 2, [s.name for s in spans]
    # each filter span is a child of its request span, in the client's trace
    assert {f.parent_span_id for f in filters} <= {s.span_id for s in servers}
    assert all(s.parent_span_id.hex() == "00f067aa0ba902b7" for s in servers)
    # OpenTelemetry's RPC conventions on the server span; the exported resource names mmguard
    attrs = {a.key: a.value.string_value for a in servers[0].attributes}
    assert attrs["rpc.system.name"] == "grpc"
    assert attrs["rpc.method"] == "inference.GRPCInferenceService/ModelInfer"
    events = [e for f in filters for e in f.events]
    assert any(e.name == "limits.reject-batch" for e in events), [e.name for e in events]
