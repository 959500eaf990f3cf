"""The requests a cell sends and the checks of the first answer, byte for byte: KServe v2 over
gRPC (a pre-serialized ``ModelInferRequest``) and over HTTP (the binary extension). Shared by
the cells of ``python -m bench.proxy``, ``python -m bench.workers`` and
``scripts/gpu_check.py``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from bench.chain_study import photo_pixels
from bench.proxy.cases import HEADER_LENGTH

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray


def payload(spec: dict[str, Any]) -> tuple[NDArray[np.float32], bytes]:
    """The tensor a cell sends and the bytes its answer must carry."""
    import numpy as np

    x = photo_pixels() if spec.get("payload") == "photo" else None
    if x is None:
        rng = np.random.default_rng(20260101 + len(spec["shape"]))
        x = rng.standard_normal(spec["shape"]).astype(np.float32)
    expected = x if spec["op"] == "identity" else (x * np.float32(2)).astype(np.float32)
    return x, expected.tobytes()


def grpc_request(spec: dict[str, Any], x: NDArray[np.float32]) -> bytes:
    try:
        from tritonclient.grpc import service_pb2 as pb
    except ImportError:  # pragma: no cover - tritonclient missing: use mmguard's copy
        from proxy.pb import grpc_service_pb2 as pb
    req = pb.ModelInferRequest(model_name=spec["model"])
    req.inputs.add(name=spec["input"], datatype="FP32", shape=list(spec["shape"]))
    req.outputs.add(name=spec["output"])
    req.raw_input_contents.append(x.tobytes())
    return bytes(req.SerializeToString())


def grpc_check(spec: dict[str, Any], answer: bytes, expected: bytes) -> None:
    try:
        from tritonclient.grpc import service_pb2 as pb
    except ImportError:  # pragma: no cover
        from proxy.pb import grpc_service_pb2 as pb
    resp = pb.ModelInferResponse.FromString(answer)
    names = [o.name for o in resp.outputs]
    if names != [spec["output"]]:
        raise AssertionError(f"outputs {names}, expected [{spec['output']!r}]")
    if list(resp.outputs[0].shape) != list(spec["shape"]):
        raise AssertionError(f"shape {list(resp.outputs[0].shape)}, expected {spec['shape']}")
    if resp.raw_output_contents[0] != expected:
        raise AssertionError("output bytes differ from the expected answer")


def http_request(spec: dict[str, Any], x: NDArray[np.float32]) -> tuple[bytes, dict[str, str]]:
    raw = x.tobytes()
    head = json.dumps({
        "inputs": [{"name": spec["input"], "shape": list(spec["shape"]), "datatype": "FP32",
                    "parameters": {"binary_data_size": len(raw)}}],
        "outputs": [{"name": spec["output"], "parameters": {"binary_data": True}}],
    }, separators=(",", ":")).encode()
    # aiohttp asks for gzip by default, and Triton then compresses its answer (600 KB through
    # zlib per request): the load generator asks for the plain body, as tritonclient does.
    headers = {HEADER_LENGTH: str(len(head)), "Content-Type": "application/octet-stream",
               "Accept-Encoding": "identity"}
    return head + raw, headers


def http_check(spec: dict[str, Any], status: int, headers: Mapping[str, str], data: bytes,
               expected: bytes) -> None:
    if status != 200:
        raise AssertionError(f"HTTP {status}: {data[:300]!r}")
    hlen = headers.get(HEADER_LENGTH)
    if hlen is None:
        raise AssertionError(f"no {HEADER_LENGTH} header: answer is JSON-only: {data[:300]!r}")
    doc = json.loads(data[:int(hlen)])
    outs = doc.get("outputs") or []
    if [o.get("name") for o in outs] != [spec["output"]]:
        raise AssertionError(f"outputs {[o.get('name') for o in outs]}, expected "
                             f"[{spec['output']!r}]")
    if outs[0].get("shape") != list(spec["shape"]):
        raise AssertionError(f"shape {outs[0].get('shape')}, expected {spec['shape']}")
    if data[int(hlen):] != expected:
        raise AssertionError("output bytes differ from the expected answer")
