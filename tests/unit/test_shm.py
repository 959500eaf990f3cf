"""proxy.shm.regions: who the client is, what a key may name, every bound before a read, inputs read
and outputs written, unregister of a region in use, and unmapping everything at the end. Regions are
real files (in a temporary directory standing in for /dev/shm); peers are real loopback sockets. """

from __future__ import annotations

import asyncio
import gc
import os
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from proxy.call import REFUSED, Call, Finish, LocalReply, Reply, RequestedOutput, Result, StreamItem
from proxy.config.model import SharedMemoryConfig
from proxy.errors import ErrorKind, ProxyError
from proxy.pb import grpc_service_pb2 as pb
from proxy.shm.peer import Connection, grpc_peer, peer_uid
from proxy.shm.regions import Budget, Infer, SharedMemory, uses_shared_memory
from proxy.telemetry import Telemetry
from proxy.tensor import Tensor
from proxy.wire import kserve_grpc, kserve_http
from proxy.wire.kserve_http import WRITTEN

ME = os.getuid()
HERE = Connection(("127.0.0.1", 1), ("127.0.0.1", 2))
X = np.arange(4, dtype=np.float32)
BUDGET = Budget(1 << 20, "listeners.grpc.max_request_bytes")


def any_model(model: str) -> bool:
    return True


@pytest.fixture
def shm_dir(tmp_path: Path) -> Path:
    return tmp_path


def registry(shm_dir: Path, **config: Any) -> SharedMemory:
    return SharedMemory(SharedMemoryConfig(system=True, **config), directory=shm_dir,
                        uid_of=lambda peer, local: ME)


def region_file(shm_dir: Path, key: str, data: bytes) -> Path:
    path = shm_dir / key
    path.write_bytes(data)
    return path


def refused(kind: ErrorKind, fn: Any, *args: Any) -> str:
    with pytest.raises(ProxyError) as info:
        fn(*args)
    assert info.value.kind is kind, info.value.message
    return info.value.message


def shm_call(inputs: list[Tensor], outputs: list[RequestedOutput] | None = None) -> Call:
    return Call(model="m", version="", inputs=inputs, outputs=outputs or [], front="grpc")


def in_region(name: str, region: str, size: int, offset: int = 0,
              datatype: str = "FP32", shape: tuple[int, ...] = (4,)) -> Tensor:
    return Tensor(name, datatype, shape, raw=b"", parameters={
        "shared_memory_region": region, "shared_memory_byte_size": size,
        "shared_memory_offset": offset})


def planed(backend: Callable[[Call], Awaitable[Reply]]) -> Infer:
    """``backend`` as the data plane runs it: the answer's ``finish`` (the regions' writes)
    before it is given back, its failure given back instead."""
    async def infer(call: Call, finish: Finish | None) -> Reply:
        refused = call.state.get(REFUSED)
        if refused is not None:
            return refused
        reply = await backend(call)
        if isinstance(reply, Result) and finish is not None:
            try:
                await finish(reply)
            except ProxyError as err:
                return LocalReply.from_error(err)
        return reply
    return infer


def planed_stream(backend: Callable[[Call], AsyncIterator[Result]]
                  ) -> Callable[[Call, Finish | None], AsyncIterator[StreamItem]]:
    """``planed`` for a stream: ``finish`` on each answer."""
    async def stream(call: Call, finish: Finish | None) -> AsyncIterator[StreamItem]:
        refused = call.state.get(REFUSED)
        if refused is not None:
            yield refused
            return
        async for result in backend(call):
            item: StreamItem = result
            if finish is not None:
                try:
                    await finish(result)
                except ProxyError as err:
                    item = LocalReply.from_error(err)
            yield item
    return stream


async def doubler(call: Call) -> Result:
    x = call.inputs[0].numpy()
    return Result(outputs=[Tensor.from_numpy("y", (x * 2).astype(np.float32))])


# --- who is asking -----------------------------------------------------------------------------


def test_grpc_peer_strings() -> None:
    assert grpc_peer("ipv4:127.0.0.1:5000") == ("127.0.0.1", 5000)
    assert grpc_peer("ipv6:[::1]:5001") == ("::1", 5001)
    assert grpc_peer("ipv6:%5B%3A%3A1%5D:5002") == ("::1", 5002)
    assert grpc_peer("unix:/tmp/sock") is None
    assert grpc_peer("") is None and grpc_peer(None) is None


@pytest.mark.parametrize("family,host", [(socket.AF_INET, "127.0.0.1"),
                                         (socket.AF_INET6, "::1")])
def test_peer_uid_is_asked_of_the_kernel(family: int, host: str) -> None:
    with socket.socket(family) as server, socket.socket(family) as client:
        server.bind((host, 0))
        server.listen()
        client.connect(server.getsockname()[:2])
        conn, peer = server.accept()
        with conn:
            here = conn.getsockname()[:2]
            assert peer_uid(peer[:2], here) == ME
            assert peer_uid(peer[:2], ("", here[1])) == ME  # the listener knows its port only
            # mmguard's own end is not the client's: the lookup is for the client's socket.
            assert peer_uid(peer[:2], (host, here[1] + 1 if here[1] < 65535 else 1)) is None
    with socket.socket(family) as gone:
        gone.bind((host, 0))
        port = gone.getsockname()[1]
    assert peer_uid((host, port), (host, 9)) is None  # no such connection


def test_client_refusals(shm_dir: Path) -> None:
    off = SharedMemory(SharedMemoryConfig(), directory=shm_dir, uid_of=lambda peer, local: ME)
    assert "shared_memory.system" in refused(ErrorKind.UNIMPLEMENTED, off.client, HERE)
    on = registry(shm_dir)
    for host in ("127.0.0.1", "::1", "::ffff:127.0.0.1"):
        assert on.client(Connection((host, 1))) == ME
    for host in ("0.0.0.0", "::", "not-an-address"):
        assert "loopback" in refused(ErrorKind.PERMISSION_DENIED, on.client,
                                     Connection((host, 1)))
    refused(ErrorKind.PERMISSION_DENIED, on.client, Connection(None))
    unknown = SharedMemory(SharedMemoryConfig(system=True), directory=shm_dir,
                           uid_of=lambda peer, local: None)
    assert "no such connection" in refused(ErrorKind.PERMISSION_DENIED, unknown.client, HERE)
    narrow = registry(shm_dir, allowed_uids=(ME + 1,))
    assert "allowed_uids" in refused(ErrorKind.PERMISSION_DENIED, narrow.client, HERE)
    on.grpc_port = 9001
    assert on.grpc_connection("ipv6:[::1]:5000") == Connection(("::1", 5000), ("", 9001))


# --- register / status / unregister ------------------------------------------------------------


def test_keys_name_one_regular_file_of_the_directory(shm_dir: Path, tmp_path_factory:
                                                     pytest.TempPathFactory) -> None:
    s = registry(shm_dir)
    outside = tmp_path_factory.mktemp("outside") / "secret"
    outside.write_bytes(b"s" * 64)
    for key in ("../secret", "/a/b", "", "/", "..", "/.", "a b", "/x" + "y" * 300):
        assert "must name one file" in refused(ErrorKind.INVALID_ARGUMENT, s.register, ME,
                                               "r", key, 0, 8)
    (shm_dir / "link").symlink_to(outside)
    assert "Unable to open" in refused(ErrorKind.INTERNAL, s.register, ME, "r", "/link", 0, 8)
    os.mkfifo(shm_dir / "fifo")
    assert "not a regular file" in refused(ErrorKind.INVALID_ARGUMENT, s.register, ME, "r",
                                           "/fifo", 0, 8)
    assert "Unable to open" in refused(ErrorKind.INTERNAL, s.register, ME, "r", "/absent", 0, 8)
    assert s.status(ME) == []


def test_a_client_registers_only_files_its_uid_owns(shm_dir: Path) -> None:
    region_file(shm_dir, "mine", b"\0" * 64)
    s = registry(shm_dir)
    message = refused(ErrorKind.PERMISSION_DENIED, s.register, ME + 1, "r", "/mine", 0, 64)
    assert f"belongs to uid {ME}" in message and f"uid {ME + 1}" in message
    s.register(ME, "r", "/mine", 0, 64)


def test_registration_bounds_and_limits(shm_dir: Path) -> None:
    region_file(shm_dir, "k", b"\0" * 64)
    s = registry(shm_dir, max_regions_per_client=2, max_region_bytes=32)
    out_of_bound = refused(ErrorKind.INVALID_ARGUMENT, s.register, ME, "r", "/k", 40, 30)
    assert out_of_bound.startswith("failed to register shared memory region 'r': invalid args")
    assert "64 bytes" in out_of_bound
    refused(ErrorKind.INVALID_ARGUMENT, s.register, ME, "r", "/k", 0, 0)
    assert "max_region_bytes" in refused(ErrorKind.INVALID_ARGUMENT, s.register, ME, "r", "/k",
                                         0, 33)
    refused(ErrorKind.INVALID_ARGUMENT, s.register, ME, "r", "/k", -1, 8)
    refused(ErrorKind.INVALID_ARGUMENT, s.register, ME, "", "/k", 0, 8)
    s.register(ME, "a", "/k", 0, 32)
    assert "already in manager" in refused(ErrorKind.ALREADY_EXISTS, s.register, ME, "a", "/k",
                                           0, 8)
    s.register(ME, "b", "k", 32, 32)  # the leading "/" is optional, as for shm_open
    assert "max_regions_per_client" in refused(ErrorKind.OVERLOADED, s.register, ME, "c", "/k",
                                               0, 8)
    assert [r.status() for r in s.status(ME)] == [
        {"name": "a", "key": "/k", "offset": 0, "byte_size": 32},
        {"name": "b", "key": "k", "offset": 32, "byte_size": 32}]


def test_names_live_in_one_namespace_per_uid(shm_dir: Path) -> None:
    region_file(shm_dir, "k", b"\0" * 8)
    s = registry(shm_dir)
    s.register(ME, "same", "/k", 0, 8)
    other = ME + 1
    assert s.status(other) == []
    refused(ErrorKind.NOT_FOUND, s.status, other, "same")
    s.unregister(other)  # all of the other uid's: none of mine
    s.unregister(other, "same")
    assert [r.name for r in s.status(ME)] == ["same"]
    call = shm_call([in_region("x", "same", 8, shape=(2,))])
    reply = asyncio.run(s.infer(call, HERE, planed(doubler), any_model, BUDGET))
    assert isinstance(reply, Result)
    s2 = SharedMemory(SharedMemoryConfig(system=True), directory=shm_dir,
                      uid_of=lambda peer, local: other)
    s2._regions = s._regions  # the same registry seen by a client of another uid
    reply = asyncio.run(s2.infer(shm_call([in_region("x", "same", 8, shape=(2,))]),
                                 HERE, planed(doubler), any_model, BUDGET))
    assert isinstance(reply, LocalReply) and reply.kind is ErrorKind.NOT_FOUND
    assert "'same'" in reply.message


# --- inference ---------------------------------------------------------------------------------


def test_inputs_read_and_outputs_written(shm_dir: Path) -> None:
    region_file(shm_dir, "in", b"\xff" * 8 + X.tobytes())
    out = region_file(shm_dir, "out", b"\0" * 32)
    s = registry(shm_dir)
    s.register(ME, "in", "/in", 0, 24)
    s.register(ME, "out", "/out", 0, 32)
    seen: list[np.ndarray[Any, Any]] = []

    async def backend(call: Call) -> Result:
        seen.append(call.inputs[0].numpy().copy())
        assert call.wire is None and "shared_memory_region" not in call.inputs[0].parameters
        assert call.outputs[0].parameters == {}  # the backend never sees the region names
        return await doubler(call)

    call = shm_call([in_region("x", "in", 16, offset=8)],
                    [RequestedOutput("y", {"shared_memory_region": "out",
                                           "shared_memory_byte_size": 16,
                                           "shared_memory_offset": 16})])
    assert uses_shared_memory(call)
    reply = asyncio.run(s.infer(call, HERE, planed(backend), any_model, BUDGET))
    assert isinstance(reply, Result)
    np.testing.assert_array_equal(seen[0], X)
    assert np.frombuffer(out.read_bytes()[16:], np.float32).tolist() == (X * 2).tolist()
    assert out.read_bytes()[:16] == b"\0" * 16
    assert call.state[WRITTEN] == frozenset({"y"})
    (y,) = reply.outputs
    assert (y.name, y.datatype, y.shape, bytes(y.raw_bytes())) == ("y", "FP32", (4,), b"")
    assert all(r.leases == 0 for r in s.status(ME))


def test_every_bound_is_checked_before_a_read(shm_dir: Path) -> None:
    region_file(shm_dir, "k", X.tobytes())
    s = registry(shm_dir)
    s.register(ME, "r", "/k", 0, 16)
    reads: list[Call] = []

    async def backend(call: Call) -> Result:
        reads.append(call)
        return await doubler(call)

    def refusal(tensor: Tensor, outputs: list[RequestedOutput] | None = None) -> LocalReply:
        reply = asyncio.run(s.infer(shm_call([tensor], outputs), HERE, planed(backend),
                                    any_model, BUDGET))
        assert isinstance(reply, LocalReply), reply
        return reply

    r = refusal(in_region("x", "r", 16, offset=8))
    assert r.kind is ErrorKind.INVALID_ARGUMENT
    assert "'x'" in r.message and "'r'" in r.message and "8" in r.message and "16" in r.message
    r = refusal(in_region("x", "r", 12))
    assert "input byte size mismatch for input 'x'" in r.message
    assert "Expected 16, got 12" in r.message
    r = refusal(in_region("x", "r", 16, offset=-4))
    assert "shared_memory_offset" in r.message
    bad = in_region("x", "r", 16)
    del bad.parameters["shared_memory_byte_size"]
    assert "shared_memory_byte_size" in refusal(bad).message
    assert refusal(in_region("x", "nope", 16)).kind is ErrorKind.NOT_FOUND
    out = RequestedOutput("y", {"shared_memory_region": "r", "shared_memory_byte_size": 16,
                                "shared_memory_offset": 4})
    assert refusal(in_region("x", "r", 16), [out]).kind is ErrorKind.INVALID_ARGUMENT
    both = RequestedOutput("y", {"shared_memory_region": "r", "shared_memory_byte_size": 16,
                                 "binary_data": True})
    assert "binary_data" in refusal(in_region("x", "r", 16), [both]).message
    assert reads == []  # no refused call reached the backend
    small = RequestedOutput("y", {"shared_memory_region": "r", "shared_memory_byte_size": 8})
    r = refusal(in_region("x", "r", 16), [small])
    assert r.kind is ErrorKind.INTERNAL and "'y'" in r.message and "16 bytes" in r.message
    assert all(region.leases == 0 for region in s.status(ME))


def test_bytes_framing_in_a_region_is_checked(shm_dir: Path) -> None:
    region_file(shm_dir, "k", struct.pack("<I", 50) + b"abc")
    s = registry(shm_dir)
    s.register(ME, "r", "/k", 0, 7)
    reply = asyncio.run(s.infer(shm_call([in_region("t", "r", 7, datatype="BYTES",
                                                    shape=(1,))]), HERE, planed(doubler),
                                any_model, BUDGET))
    assert isinstance(reply, LocalReply) and reply.kind is ErrorKind.INVALID_ARGUMENT
    assert "expecting string of length 50 but only 3 bytes available" in reply.message


def test_a_file_cut_after_registration_is_an_error_not_a_crash(shm_dir: Path) -> None:
    path = region_file(shm_dir, "k", X.tobytes())
    s = registry(shm_dir)
    s.register(ME, "r", "/k", 0, 16)
    os.truncate(path, 4)
    reply = asyncio.run(s.infer(shm_call([in_region("x", "r", 16)]), HERE, planed(doubler),
                                any_model, BUDGET))
    assert isinstance(reply, LocalReply) and reply.kind is ErrorKind.INVALID_ARGUMENT
    assert "cut after registration" in reply.message


def test_zero_copy_reads_in_place(shm_dir: Path) -> None:
    region_file(shm_dir, "k", X.tobytes())
    s = registry(shm_dir, zero_copy=True)
    region = s.register(ME, "r", "/k", 0, 16)
    call = shm_call([in_region("x", "r", 16)])

    async def backend(c: Call) -> Result:
        raw = c.inputs[0].raw
        assert isinstance(raw, memoryview) and raw.obj is region.mapping
        return await doubler(c)

    reply = asyncio.run(s.infer(call, HERE, planed(backend), any_model, BUDGET))
    assert isinstance(reply, Result)


def mapped(path: Path) -> bool:
    return str(path) in Path("/proc/self/maps").read_text()


def test_unregister_in_use_waits_for_the_call(shm_dir: Path) -> None:
    path = region_file(shm_dir, "k", X.tobytes())
    s = registry(shm_dir, zero_copy=True)
    region = s.register(ME, "r", "/k", 0, 16)

    async def scenario() -> Result | LocalReply:
        started, release = asyncio.Event(), asyncio.Event()

        async def slow(call: Call) -> Result:
            started.set()
            await release.wait()
            return await doubler(call)

        task = asyncio.create_task(s.infer(shm_call([in_region("x", "r", 16)]),
                                           HERE, planed(slow), any_model, BUDGET))
        await started.wait()
        s.unregister(ME)
        assert s.status(ME) == [] and mapped(path) and region.mapping is not None
        release.set()
        return await task

    reply = asyncio.run(scenario())
    assert isinstance(reply, Result)
    np.testing.assert_array_equal(reply.outputs[0].numpy(), X * 2)
    gc.collect()
    assert region.mapping is None and not mapped(path)  # unmapped once the call let go


def test_close_unmaps_everything(shm_dir: Path) -> None:
    region_file(shm_dir, "k", b"\0" * 16)
    s = registry(shm_dir, zero_copy=True)
    regions = [s.register(ME, n, "/k", 0, 16) for n in ("a", "b")]
    assert mapped(shm_dir / "k")
    s.close()
    assert s.status(ME) == [] and not mapped(shm_dir / "k")
    for r in regions:
        with pytest.raises(OSError):
            os.fstat(r.fd)  # closed


# --- the decoders leave a placeholder for proxy.shm.regions, or refuse
# -----------------------------------


@pytest.fixture
def grpc_mixed_body() -> Iterator[bytes]:
    req = pb.ModelInferRequest(model_name="m")
    a = req.inputs.add(name="a", datatype="FP32", shape=[4])
    a.parameters["shared_memory_region"].string_param = "r"
    a.parameters["shared_memory_byte_size"].int64_param = 16
    req.inputs.add(name="b", datatype="FP32", shape=[4])
    req.raw_input_contents.append(X.tobytes())  # only b's: a is in the region
    yield req.SerializeToString()


def test_grpc_decoder_maps_raw_contents_past_region_inputs(grpc_mixed_body: bytes) -> None:
    call = kserve_grpc.decode_request(grpc_mixed_body, shared_memory=True)
    a, b = call.inputs
    assert a.parameters["shared_memory_region"] == "r" and bytes(a.raw_bytes()) == b""
    assert bytes(b.raw_bytes()) == X.tobytes()
    assert "ModelStreamInfer" in refused(ErrorKind.UNIMPLEMENTED, kserve_grpc.decode_request,
                                         grpc_mixed_body)


def test_http_decoder_refuses_a_region_input_with_data_too() -> None:
    body = (b'{"inputs":[{"name":"a","datatype":"FP32","shape":[4],"data":[1,2,3,4],'
            b'"parameters":{"shared_memory_region":"r","shared_memory_byte_size":16}}]}')
    assert "send it one way" in refused(ErrorKind.INVALID_ARGUMENT, kserve_http.decode_request,
                                        body, None, "m", "", None, True)
    refused(ErrorKind.UNIMPLEMENTED, kserve_http.decode_request, body, None, "m", "")


def test_regions_and_refusals_are_metrics(shm_dir: Path) -> None:
    region_file(shm_dir, "k", X.tobytes())
    telemetry = Telemetry()
    s = SharedMemory(SharedMemoryConfig(system=True), directory=shm_dir,
                     uid_of=lambda peer, local: ME, telemetry=telemetry)
    s.register(ME, "r", "/k", 0, 16)
    reply = asyncio.run(s.infer(shm_call([in_region("x", "r", 16, offset=4)]),
                                HERE, planed(doubler), any_model, BUDGET))
    assert isinstance(reply, LocalReply)
    value = telemetry.registry.get_sample_value
    assert value("mmguard_shm_regions") == 1
    assert value("mmguard_shm_refusals_total",
                 {"operation": "infer", "kind": "invalid_argument"}) == 1
    s.close()
    assert value("mmguard_shm_regions") == 0


# --- after routing, within the listener's limit (issue 26 item 2) -------------------------------


def test_no_region_is_read_for_a_model_that_is_not_served(shm_dir: Path) -> None:
    region_file(shm_dir, "k", X.tobytes())
    s = registry(shm_dir)
    region = s.register(ME, "r", "/k", 0, 16)
    os.close(region.fd)
    region.fd = -1  # any read now fails with EBADF: the test sees whether one was tried
    asked: list[Call] = []

    async def plane(call: Call) -> LocalReply:
        asked.append(call)
        return LocalReply(ErrorKind.NOT_FOUND, f"model '{call.model}' is not served by mmguard")

    call = shm_call([in_region("x", "r", 16)] * 4)
    reply = asyncio.run(s.infer(call, HERE, planed(plane), lambda model: False, BUDGET))
    assert isinstance(reply, LocalReply) and reply.kind is ErrorKind.NOT_FOUND
    assert asked == [call] and region.leases == 0
    region.fd = os.open(shm_dir / "k", os.O_RDONLY)  # for close()


def test_shared_memory_counts_against_the_listeners_request_limit(shm_dir: Path) -> None:
    region_file(shm_dir, "k", X.tobytes())
    s = registry(shm_dir)
    region = s.register(ME, "r", "/k", 0, 16)
    reads: list[Call] = []

    async def backend(call: Call) -> Result:
        reads.append(call)
        return await doubler(call)

    inline = Tensor.from_numpy("z", np.zeros(8, np.float32))  # 32 bytes sent inline
    call = shm_call([in_region("x", "r", 16), in_region("w", "r", 16), inline])
    reply = asyncio.run(s.infer(call, HERE, planed(backend), any_model,
                                Budget(63, "listeners.http.max_request_bytes")))
    assert isinstance(reply, LocalReply) and reply.kind is ErrorKind.TOO_LARGE
    assert reply.message == ("the request's inputs total 64 bytes with those in shared memory; "
                             "this listener accepts at most 63 bytes "
                             "(listeners.http.max_request_bytes)")
    assert reads == [] and region.leases == 0
    assert call.inputs[0].raw == b""  # nothing was read
    call = shm_call([in_region("x", "r", 16), in_region("w", "r", 16), inline])
    reply = asyncio.run(s.infer(call, HERE, planed(backend), any_model,
                                Budget(64, "listeners.http.max_request_bytes")))
    assert isinstance(reply, Result) and len(reads) == 1


def test_a_streamed_request_reads_and_writes_its_regions_for_every_answer(
        shm_dir: Path) -> None:
    region_file(shm_dir, "in", X.tobytes())
    out = region_file(shm_dir, "out", b"\0" * 16)
    s = registry(shm_dir)
    s.register(ME, "in", "/in", 0, 16)
    s.register(ME, "out", "/out", 0, 16)

    async def two_answers(call: Call) -> AsyncIterator[Result]:
        for k in (2, 3):
            yield Result(outputs=[Tensor.from_numpy(
                "y", (call.inputs[0].numpy() * k).astype(np.float32))])

    async def run(outputs: list[RequestedOutput]) -> list[Any]:
        call = shm_call([in_region("x", "in", 16)], outputs)
        items = [item async for item in s.stream(call, HERE, planed_stream(two_answers),
                                                 any_model, BUDGET)]
        return [*items, out.read_bytes()]

    first, second, written = asyncio.run(run([RequestedOutput("y", {
        "shared_memory_region": "out", "shared_memory_byte_size": 16})]))
    assert isinstance(first, Result) and isinstance(second, Result)
    assert np.frombuffer(written, np.float32).tolist() == (X * 3).tolist()  # the last answer
    assert all(r.leases == 0 for r in s.status(ME))
    (refusal, _) = asyncio.run(run([RequestedOutput("y", {
        "shared_memory_region": "out", "shared_memory_byte_size": 16,
        "shared_memory_offset": 8})]))
    assert isinstance(refusal, LocalReply) and refusal.kind is ErrorKind.INVALID_ARGUMENT
