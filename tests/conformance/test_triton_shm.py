"""System shared memory, the way ``simple_*_shm_client`` programs use it: the same
``tritonclient.utils.shared_memory`` code direct against Triton and through mmguard (both Triton
backends), over gRPC and HTTP, with the same assertions and the same status codes.

Model: ``small_fp32`` (x FP32 [1, 16] → y = 2x). Each test makes its own regions under
/dev/shm with names unique to the test, and removes them whatever happens.
"""

from __future__ import annotations

import os
import queue
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from tests.conformance.conftest import Target

X = np.arange(16, dtype=np.float32).reshape(1, 16)
NBYTES = X.nbytes  # 64
# The code each protocol's client sees, direct and through mmguard alike.
CODES = {
    "grpc": {"invalid": "StatusCode.INVALID_ARGUMENT", "not_found": "StatusCode.NOT_FOUND",
             "exists": "StatusCode.ALREADY_EXISTS", "internal": "StatusCode.INTERNAL"},
    "http": {"invalid": "400", "not_found": "404", "exists": "400", "internal": "500"},
}


@dataclass
class Shm:
    """One client of one protocol, with the regions it made (all cleaned up at the end)."""

    protocol: str
    client: Any
    module: ModuleType
    tag: str
    handles: dict[str, Any]

    def region(self, name: str, size: int) -> tuple[str, str, Any]:
        """Create /dev/shm/<key> of ``size`` bytes; returns (region name, key, handle)."""
        region, key = f"{self.tag}_{name}", f"/{self.tag}_{name}"
        handle = shm.create_shared_memory_region(region, key, size)
        self.handles[region] = handle
        return region, key, handle

    def code(self, what: str) -> str:
        return CODES[self.protocol][what]

    def infer(self, in_region: str | None, in_size: int = NBYTES, in_offset: int = 0,
              out_region: str | None = None, out_size: int = NBYTES,
              out_offset: int = 0) -> Any:
        x = self.module.InferInput("x", [1, 16], "FP32")
        if in_region is None:
            x.set_data_from_numpy(X)
        else:
            x.set_shared_memory(in_region, in_size, in_offset)
        y = self.module.InferRequestedOutput("y")
        if out_region is not None:
            y.set_shared_memory(out_region, out_size, out_offset)
        return self.client.infer("small_fp32", [x], outputs=[y])


@pytest.fixture(params=["grpc", "http"])
def shm_client(request: pytest.FixtureRequest, target: Target) -> Iterator[Shm]:
    protocol: str = request.param
    module: ModuleType = grpcclient if protocol == "grpc" else httpclient
    url = target.grpc_url if protocol == "grpc" else target.http_url
    client = module.InferenceServerClient(url)
    tag = f"mmg{os.getpid()}_{secrets.token_hex(3)}"
    s = Shm(protocol, client, module, tag, {})
    try:
        yield s
    finally:
        for region in list(s.handles):
            try:
                client.unregister_system_shared_memory(region)
            except InferenceServerException:
                pass
        for handle in s.handles.values():
            shm.destroy_shared_memory_region(handle)
        client.close()


def fails(code: str, fn: Any, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(InferenceServerException) as info:
        fn(*args, **kwargs)
    assert info.value.status() == code, info.value.message()
    return str(info.value.message())


def status_of(s: Shm, name: str = "") -> dict[str, dict[str, Any]]:
    """Region name → {key, offset, byte_size}, for the regions this test made."""
    raw = s.client.get_system_shared_memory_status(name) if name else \
        s.client.get_system_shared_memory_status()
    if s.protocol == "grpc":
        entries = [{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size}
                   for r in raw.regions.values()]
    else:
        entries = list(raw)
    return {e["name"]: {k: int(e[k]) if k != "key" else e[k] for k in ("key", "offset",
                                                                       "byte_size")}
            for e in entries if e["name"].startswith(s.tag)}


def test_inputs_and_outputs_in_regions(shm_client: Shm) -> None:
    s = shm_client
    in_name, in_key, in_handle = s.region("in", NBYTES)
    out_name, out_key, out_handle = s.region("out", 2 * NBYTES)
    shm.set_shared_memory_region(in_handle, [X])
    s.client.register_system_shared_memory(in_name, in_key, NBYTES)
    s.client.register_system_shared_memory(out_name, out_key, 2 * NBYTES)
    assert status_of(s) == {in_name: {"key": in_key, "offset": 0, "byte_size": NBYTES},
                            out_name: {"key": out_key, "offset": 0, "byte_size": 2 * NBYTES}}
    assert status_of(s, in_name) == {in_name: {"key": in_key, "offset": 0,
                                               "byte_size": NBYTES}}

    result = s.infer(in_name, out_region=out_name, out_offset=NBYTES)
    out = result.get_output("y")
    if s.protocol == "grpc":
        assert (out.datatype, list(out.shape)) == ("FP32", [1, 16])
        assert list(result.get_response().raw_output_contents) == [b""]  # bytes in the region
    else:
        assert (out["datatype"], out["shape"]) == ("FP32", [1, 16])
        assert "data" not in out and "binary_data_size" not in out.get("parameters", {})
    got = shm.get_contents_as_numpy(out_handle, np.float32, [2, 16])
    np.testing.assert_array_equal(got[0], np.zeros(16, np.float32))  # before the offset: kept
    np.testing.assert_array_equal(got[1], X[0] * 2)

    # An input from a region with its output inline, and an inline input into a region.
    np.testing.assert_array_equal(s.infer(in_name).as_numpy("y"), X * 2)
    shm.set_shared_memory_region(out_handle, [np.zeros((2, 16), np.float32)])
    s.infer(None, out_region=out_name)
    np.testing.assert_array_equal(shm.get_contents_as_numpy(out_handle, np.float32, [1, 16]),
                                  X * 2)

    s.client.unregister_system_shared_memory(in_name)
    assert list(status_of(s)) == [out_name]
    s.client.unregister_system_shared_memory("never_registered")  # not an error, as in Triton
    fails(s.code("not_found"), s.infer, in_name)  # gone: the name no longer resolves
    s.client.unregister_system_shared_memory()
    assert status_of(s) == {}


def test_register_refusals(shm_client: Shm) -> None:
    s = shm_client
    name, key, _ = s.region("reg", NBYTES)
    s.client.register_system_shared_memory(name, key, NBYTES)
    fails(s.code("exists"), s.client.register_system_shared_memory, name, key, NBYTES)
    # A region larger than its file, or starting past its end (a key nobody registered yet:
    # Triton refuses a registered key with other bounds differently, INTERNAL).
    _, free_key, _ = s.region("free", NBYTES)
    fails(s.code("invalid"), s.client.register_system_shared_memory, name + "_big", free_key,
          4096)
    fails(s.code("invalid"), s.client.register_system_shared_memory, name + "_past", free_key,
          8, offset=NBYTES)
    fails(s.code("internal"), s.client.register_system_shared_memory, name + "_nokey",
          f"/{s.tag}_no_such_key", NBYTES)
    fails(s.code("not_found"), s.client.get_system_shared_memory_status, name + "_unknown")
    assert list(status_of(s)) == [name]


def test_region_too_small(shm_client: Shm) -> None:
    s = shm_client
    small, small_key, _ = s.region("small", 16)
    big, big_key, big_handle = s.region("big", NBYTES)
    shm.set_shared_memory_region(big_handle, [X])
    s.client.register_system_shared_memory(small, small_key, 16)
    s.client.register_system_shared_memory(big, big_key, NBYTES)
    message = fails(s.code("invalid"), s.infer, small)  # 64 bytes asked of a 16-byte region
    assert small in message
    # A byte size that fits the region but not the shape × datatype of the input.
    message = fails(s.code("invalid"), s.infer, big, in_size=NBYTES - 4)
    assert "'x'" in message and str(NBYTES) in message
    # The answer (64 bytes) does not fit the output's 16 bytes: Triton says INTERNAL.
    message = fails(s.code("internal"), s.infer, big, out_region=small, out_size=16)
    assert "'y'" in message and "16" in message


def test_wrong_offset(shm_client: Shm) -> None:
    s = shm_client
    name, key, handle = s.region("off", NBYTES)
    shm.set_shared_memory_region(handle, [X])
    s.client.register_system_shared_memory(name, key, NBYTES)
    message = fails(s.code("invalid"), s.infer, name, in_offset=32)
    assert name in message
    fails(s.code("invalid"), s.infer, name, in_offset=NBYTES + 8, in_size=0)
    fails(s.code("invalid"), s.infer, name, out_region=name, out_offset=32)
    fails(s.code("not_found"), s.infer, name + "_unknown")
    fails(s.code("not_found"), s.infer, name, out_region=name + "_unknown")
    # The region is still good after every refusal.
    np.testing.assert_array_equal(s.infer(name).as_numpy("y"), X * 2)


@pytest.fixture
def stream_client(target: Target) -> Iterator[Shm]:
    """A gRPC client of ``target`` for ``ModelStreamInfer`` (shared memory on streams)."""
    client = grpcclient.InferenceServerClient(target.grpc_url)
    s = Shm("grpc", client, grpcclient, f"mmg{os.getpid()}_{secrets.token_hex(3)}", {})
    try:
        yield s
    finally:
        client.stop_stream()
        for region in list(s.handles):
            try:
                client.unregister_system_shared_memory(region)
            except InferenceServerException:
                pass
        for handle in s.handles.values():
            shm.destroy_shared_memory_region(handle)
        client.close()


def _stream(s: Shm, requests: list[dict[str, Any]]) -> list[Any]:
    """Send each request on one stream; the results (or errors) in the order they came."""
    answers: queue.Queue[Any] = queue.Queue()
    s.client.start_stream(callback=lambda result, error: answers.put(error or result))
    for i, r in enumerate(requests):
        x = grpcclient.InferInput("x", [1, 16], "FP32")
        if r.get("in") is None:
            x.set_data_from_numpy(X)
        else:
            x.set_shared_memory(r["in"], r.get("in_size", NBYTES), r.get("in_offset", 0))
        y = grpcclient.InferRequestedOutput("y")
        if r.get("out") is not None:
            y.set_shared_memory(r["out"], r.get("out_size", NBYTES), r.get("out_offset", 0))
        s.client.async_stream_infer("small_fp32", [x], outputs=[y], request_id=str(i))
    got = [answers.get(timeout=30) for _ in requests]
    s.client.stop_stream()
    return got


def test_stream_inputs_and_outputs_in_regions(stream_client: Shm) -> None:
    """Issue 28 item 5: ``ModelStreamInfer`` takes tensors in system shared memory as
    ``ModelInfer`` does, with the same bounds checks; direct and through mmguard alike."""
    s = stream_client
    in_name, in_key, in_handle = s.region("sin", NBYTES)
    out_name, out_key, out_handle = s.region("sout", 2 * NBYTES)
    small, small_key, _ = s.region("ssmall", 16)
    shm.set_shared_memory_region(in_handle, [X])
    for name, key, size in ((in_name, in_key, NBYTES), (out_name, out_key, 2 * NBYTES),
                            (small, small_key, 16)):
        s.client.register_system_shared_memory(name, key, size)

    ok, into, bad_size, past, unknown, too_small, after = _stream(s, [
        {"in": in_name}, {"in": in_name, "out": out_name, "out_offset": NBYTES},
        {"in": in_name, "in_size": NBYTES - 4}, {"in": in_name, "in_offset": 32},
        {"in": in_name + "_unknown"}, {"in": small, "in_size": 16}, {}])
    np.testing.assert_array_equal(ok.as_numpy("y"), X * 2)
    assert list(into.get_response().raw_output_contents) == [b""]  # the bytes are in the region
    got = shm.get_contents_as_numpy(out_handle, np.float32, [2, 16])
    np.testing.assert_array_equal(got[1], X[0] * 2)
    np.testing.assert_array_equal(got[0], np.zeros(16, np.float32))
    for error in (bad_size, past, unknown, too_small):
        assert isinstance(error, InferenceServerException), error
    assert "'x'" in bad_size.message() and str(NBYTES) in bad_size.message()
    assert in_name in past.message()
    assert in_name + "_unknown" in unknown.message()
    np.testing.assert_array_equal(after.as_numpy("y"), X * 2)  # the stream went on
