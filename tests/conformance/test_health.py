"""Health and readiness, the first thing every client checks: the same answers direct and
through mmguard, over both protocols."""

from __future__ import annotations

import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.conformance.conftest import Target


def test_server_and_model_health(target: Target) -> None:
    http = httpclient.InferenceServerClient(target.http_url)
    grpc = grpcclient.InferenceServerClient(target.grpc_url)
    try:
        assert http.is_server_live() and http.is_server_ready()
        assert grpc.is_server_live() and grpc.is_server_ready()
        assert http.is_model_ready("identity_fp32") and grpc.is_model_ready("identity_fp32")
        assert not http.is_model_ready("no_such_model")
        assert not grpc.is_model_ready("no_such_model")
    finally:
        http.close()
        grpc.close()
