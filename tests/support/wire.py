"""Raw KServe v2 requests, built by hand so tests control every byte on the wire."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import grpc

from proxy.pb import grpc_service_pb2 as pb

INFER = "/inference.GRPCInferenceService/ModelInfer"


def grpc_infer_raw(url: str, body: bytes, timeout: float = 10,
                   metadata: tuple[tuple[str, str], ...] = ()) -> tuple[bytes, Any]:
    """Send raw ModelInferRequest bytes; returns (response bytes, trailing metadata)."""
    with grpc.insecure_channel(url) as ch:
        rpc = ch.unary_unary(INFER)
        resp, call = rpc.with_call(body, timeout=timeout, metadata=metadata)
        return resp, call.trailing_metadata()


def grpc_request(model: str, tensors: list[tuple[str, str, list[int], bytes]],
                 outputs: list[str] = ()) -> bytes:  # type: ignore[assignment]
    req = pb.ModelInferRequest(model_name=model)
    for name, dt, shape, raw in tensors:
        req.inputs.add(name=name, datatype=dt, shape=shape)
        req.raw_input_contents.append(raw)
    for o in outputs:
        req.outputs.add(name=o)
    return bytes(req.SerializeToString())


def http_binary_body(tensors: list[tuple[str, str, list[int], bytes]],
                     outputs: list[str] = (),  # type: ignore[assignment]
                     binary_outputs: bool = True) -> tuple[bytes, int]:
    head: dict[str, Any] = {"inputs": [
        {"name": n, "datatype": dt, "shape": shape, "parameters": {"binary_data_size": len(raw)}}
        for n, dt, shape, raw in tensors]}
    if outputs:
        head["outputs"] = [{"name": o, "parameters": {"binary_data": binary_outputs}}
                           for o in outputs]
    header = json.dumps(head).encode()
    return header + b"".join(raw for *_, raw in tensors), len(header)


def http_post(url: str, path: str, body: bytes, headers: dict[str, str] | None = None,
              timeout: float = 10) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(f"http://{url}{path}", data=body, method="POST",
                                 headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        with e:  # an error response holds its socket until closed
            return e.code, dict(e.headers), e.read()


def split_binary_response(headers: dict[str, str], body: bytes) -> tuple[dict[str, Any], bytes]:
    hlen = int(headers["Inference-Header-Content-Length"])
    return json.loads(body[:hlen]), body[hlen:]
