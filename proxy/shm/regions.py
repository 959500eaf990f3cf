"""System shared memory for v2 clients: Triton's ``systemsharedmemory`` extension, in a sidecar.

Guards against a sidecar that maps memory on a client's word becoming a confused deputy (one
client reading or overwriting another's region, a key out of /dev/shm, a read past a region's
end), while a ``simple_grpc_shm_client``-style client gets the same answer as direct.

What MUST hold (the security model, docs/shared-memory.md):

- Off unless ``shared_memory.system`` is true; then only loopback peers may use it.
- The client is the uid that owns its socket, asked of the kernel (sock_diag, an exact lookup
  of the connection), never taken from the request. Region names live in one namespace per uid:
  status, use and unregister only ever see the caller's own regions.
- A key names one file directly under /dev/shm (no "/", no ".."), opened without following a
  symlink; it must be a regular file owned by the client's uid. mmguard opens on a client's behalf
  only what that client's uid owns, so it grants nothing the kernel does not grant already.
- Every bound is checked before a byte is read or written: at registration offset + byte_size
  within the file, per tensor offset + byte_size within the region, and an input's byte_size
  equal to shape × datatype.

Inputs are read with one ``pread`` each (``zero_copy``: a memoryview over a mapping, read in
place) and forwarded inline; outputs are written into the client's regions after the backend
answered, and the answer carries their name, datatype and shape but no bytes, as Triton's does.
Why not map by default: the client owns the file, and one that shrinks it while mmguard has it
mapped turns mmguard's next read into SIGBUS, which kills the process for every client; a pread
of a shrunk file is a short read, answered as a clear error.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import mmap
import os
import re
import stat
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import Counter, Gauge

from proxy.call import REFUSED, Call, Finish, LocalReply, Reply, Result, StreamItem
from proxy.config.model import SharedMemoryConfig
from proxy.errors import ErrorKind, ProxyError
from proxy.shm.peer import Connection, UidLookup, grpc_peer, peer_uid
from proxy.telemetry import Telemetry
from proxy.tensor import Payload, Tensor, itemsize
from proxy.wire.kserve_http import WRITTEN

log = logging.getLogger("mmguard.shm")

REGION, OFFSET, BYTE_SIZE = ("shared_memory_region", "shared_memory_offset",
                             "shared_memory_byte_size")
SHM_PARAMS = frozenset((REGION, OFFSET, BYTE_SIZE))
_KEY = re.compile(r"/?([A-Za-z0-9._-]{1,255})")

Infer = Callable[[Call, Finish | None], Awaitable[Reply]]  # the data plane's infer
Stream = Callable[[Call, Finish | None], AsyncIterator[StreamItem]]  # and its stream


@dataclass(eq=False)
class Region:
    """One registered region: bytes [offset, offset + byte_size) of the file ``key``, read and
    written through its open ``fd`` (or, with ``zero_copy``, through ``view`` over a mapping)."""

    name: str
    key: str
    offset: int
    byte_size: int
    owner: int
    fd: int
    mapping: mmap.mmap | None = None
    view: memoryview | None = None
    leases: int = 0
    retired: bool = False

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "offset": self.offset,
                "byte_size": self.byte_size}

    def span(self, what: str, params: dict[str, Any]) -> tuple[int, int]:
        """(offset, size) in the region that a tensor's parameters name, bounds-checked."""
        offset, size = params.get(OFFSET, 0), params.get(BYTE_SIZE)
        for key, value in ((OFFSET, offset), (BYTE_SIZE, size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                                 f"{what}: {key} must be a non-negative integer, got {value!r}")
        assert isinstance(size, int) and isinstance(offset, int)
        # Triton's words and order first: an offset at or past the end, then the span.
        if offset >= self.byte_size:
            raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                             f"Invalid offset for shared memory region: '{self.name}' ({what}: "
                             f"shared_memory_offset {offset}, the region has {self.byte_size} "
                             "bytes)")
        if offset + size > self.byte_size:
            raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                             f"Invalid offset + byte size for shared memory region: "
                             f"'{self.name}' ({what}: shared_memory_offset {offset} + "
                             f"shared_memory_byte_size {size} runs past its end, "
                             f"{self.byte_size} bytes)")
        return offset, size

    def read(self, what: str, offset: int, size: int) -> Payload:
        if self.view is not None:
            return self.view[offset:offset + size]
        data = os.pread(self.fd, size, self.offset + offset)
        if len(data) != size:  # the client shrank its file after registering it
            raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                             f"{what}: region '{self.name}' ({self.key}) ends after "
                             f"{self.offset + offset + len(data)} bytes now; it was cut after "
                             "registration")
        return data

    def write(self, offset: int, data: memoryview) -> None:
        if self.view is not None:
            self.view[offset:offset + len(data)] = data
        else:  # never past the region's bounds: span() checked them against byte_size
            os.pwrite(self.fd, data, self.offset + offset)

    def close(self) -> None:
        if self.view is not None:
            self.view.release()
        if self.mapping is not None:
            try:
                self.mapping.close()
            except BufferError:  # a tensor still views it: unmapped when the last view goes
                log.debug("region %s still viewed; unmapped when released", self.name)
            self.mapping = None
        os.close(self.fd)


@dataclass
class Lease:
    """The regions one call uses, pinned until its answer is written (unregister waits)."""

    regions: list[Region] = field(default_factory=list)
    outputs: dict[str, tuple[Region, int, int]] = field(default_factory=dict)

    def pin(self, region: Region) -> None:
        region.leases += 1
        self.regions.append(region)

    def release(self) -> None:
        for region in self.regions:
            region.leases -= 1
            if region.retired and region.leases == 0:
                region.close()
        self.regions.clear()
        self.outputs.clear()


@dataclass(frozen=True)
class Budget:
    """What one call may read from shared memory: the listener's own request limit, counted
    with the call's inline inputs (a region is not a way around ``max_request_bytes``)."""

    limit: int
    setting: str
    """The key that sets ``limit``, named in the refusal."""


READ_INLINE_BYTES = 1024 * 1024
"""Shared memory read on the event loop at most; a bigger read runs in a worker thread."""


def uses_shared_memory(call: Call) -> bool:
    return (any(REGION in t.parameters for t in call.inputs)
            or any(REGION in o.parameters for o in call.outputs))


class SharedMemory:
    """The registry of client regions for one mmguard process (both fronts share it)."""

    def __init__(self, config: SharedMemoryConfig | None = None,
                 directory: Path = Path("/dev/shm"), uid_of: UidLookup = peer_uid,
                 telemetry: Telemetry | None = None) -> None:
        self.config = config or SharedMemoryConfig()
        self.directory = directory
        self._uid_of = uid_of
        self._regions: dict[tuple[int, str], Region] = {}
        self.grpc_port = 0  # set by the server once it has bound the gRPC listener
        self._gauge: Any = None
        self._refusals: Any = None
        if telemetry is not None:
            self._gauge = telemetry.metric(Gauge, "mmguard_shm_regions",
                                           "System shared memory regions registered.", [])
            self._refusals = telemetry.metric(
                Counter, "mmguard_shm_refusals_total",
                "Shared memory calls and tensors refused, by operation and error kind.",
                ["operation", "kind"])

    def refused(self, operation: str, err: ProxyError) -> None:
        """Count a refusal (register, status, unregister, infer); the client got its reason."""
        if self._refusals is not None:
            self._refusals.labels(operation, err.kind.value).inc()
        log.debug("shared memory %s refused: %s", operation, err.message)

    def _count(self) -> None:
        if self._gauge is not None:
            self._gauge.set(len(self._regions))

    # --- who is asking ----------------------------------------------------------------------

    def grpc_connection(self, peer: str | None) -> Connection:
        """A gRPC caller (grpc.aio tells the peer only; the port is the listener's)."""
        return Connection(grpc_peer(peer), ("", self.grpc_port))

    def client(self, connection: Connection) -> int:
        """The caller's uid, or a refusal saying why it may not use shared memory."""
        peer = connection.peer
        if not self.config.system:
            raise ProxyError(ErrorKind.UNIMPLEMENTED,
                             "system shared memory is off in this mmguard (set "
                             "shared_memory.system: true; see docs/shared-memory.md); send "
                             "tensors inline")
        host = peer[0] if peer else "unknown"
        if peer is None or not _loopback(host):
            raise ProxyError(ErrorKind.PERMISSION_DENIED,
                             f"system shared memory is only for clients on this host; peer "
                             f"{host} is not a loopback address")
        uid = self._uid_of(peer, connection.local)
        if uid is None:
            raise ProxyError(ErrorKind.PERMISSION_DENIED,
                             f"cannot tell which user owns the client socket {host}:{peer[1]} "
                             "(the kernel knows no such connection), so no shared memory for it")
        allowed = self.config.allowed_uids
        if allowed is not None and uid not in allowed:
            raise ProxyError(ErrorKind.PERMISSION_DENIED,
                             f"uid {uid} may not use shared memory here "
                             "(shared_memory.allowed_uids)")
        return uid

    # --- register / status / unregister -----------------------------------------------------

    def register(self, owner: int, name: str, key: str, offset: int, byte_size: int) -> Region:
        if not name:
            raise ProxyError(ErrorKind.INVALID_ARGUMENT, "a shared memory region needs a name")
        if (owner, name) in self._regions:
            raise ProxyError(ErrorKind.ALREADY_EXISTS,
                             f"shared memory region '{name}' already in manager")
        mine = sum(1 for o, _ in self._regions if o == owner)
        if mine >= self.config.max_regions_per_client:
            raise ProxyError(ErrorKind.OVERLOADED,
                             f"uid {owner} already holds {mine} shared memory regions "
                             f"(shared_memory.max_regions_per_client); unregister some first")
        for field_name, value in (("offset", offset), ("byte_size", byte_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                                 f"region '{name}': {field_name} must be a non-negative integer, "
                                 f"got {value!r}")
        if byte_size == 0 or byte_size > self.config.max_region_bytes:
            raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                             f"region '{name}': byte_size {byte_size} is outside 1.."
                             f"{self.config.max_region_bytes} (shared_memory.max_region_bytes)")
        region = self._open(owner, name, key, offset, byte_size)
        self._regions[(owner, name)] = region
        self._count()
        log.debug("shared memory region registered",
                 extra={"fields": {"region": name, "key": key, "offset": offset,
                                   "byte_size": byte_size, "uid": owner}})
        return region

    def _open(self, owner: int, name: str, key: str, offset: int, byte_size: int) -> Region:
        match = _KEY.fullmatch(key)
        if match is None or match.group(1) in (".", ".."):
            raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                             f"region '{name}': key {key!r} must name one file of "
                             f"{self.directory} (letters, digits, '.', '_', '-'; no '/')")
        path = self.directory / match.group(1)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            # Triton answers INTERNAL for a key it cannot open; the same code, a clearer reason.
            raise ProxyError(ErrorKind.INTERNAL,
                             f"Unable to open shared memory region: '{key}' "
                             f"({path}: {exc.strerror})") from None
        try:
            _check_file(os.fstat(fd), name, key, owner, offset + byte_size)
            region = Region(name, key, offset, byte_size, owner, fd)
            if self.config.zero_copy:
                region.mapping = mmap.mmap(fd, offset + byte_size, mmap.MAP_SHARED,
                                           mmap.PROT_READ | mmap.PROT_WRITE)
                region.view = memoryview(region.mapping)[offset:offset + byte_size]
            return region
        except BaseException:
            os.close(fd)
            raise

    def status(self, owner: int, name: str = "") -> list[Region]:
        if name:
            region = self._regions.get((owner, name))
            if region is None:
                raise ProxyError(ErrorKind.NOT_FOUND,
                                 f"Unable to find system shared memory region: '{name}'")
            return [region]
        return [r for (o, _), r in self._regions.items() if o == owner]

    def unregister(self, owner: int, name: str = "") -> None:
        """Drop one region (or all of the caller's; an unknown name is not an error, as in
        Triton). A region in use by a call in flight is unmapped when that call ends."""
        names = [name] if name else [n for o, n in self._regions if o == owner]
        for n in names:
            region = self._regions.pop((owner, n), None)
            if region is None:
                continue
            region.retired = True
            if region.leases == 0:
                region.close()
            self._count()
            log.debug("shared memory region unregistered",
                     extra={"fields": {"region": n, "uid": owner, "in_use": region.leases}})

    def close(self) -> None:
        """Unmap everything (shutdown; calls have drained)."""
        regions = list(self._regions.values())
        self._regions.clear()
        self._count()
        for region in regions:
            region.retired = True
            region.close()

    # --- inference --------------------------------------------------------------------------

    async def infer(self, call: Call, connection: Connection, infer: Infer,
                    serves: Callable[[str], bool], budget: Budget,
                    finish: Finish | None = None) -> Reply:
        """Run ``infer`` on a call whose tensors use regions: inputs read from them, outputs
        written into them (``_writer``); no region is read for a model that is not served."""
        if not serves(call.model):
            return await infer(call, finish)
        try:
            lease = await self._attach(self.client(connection), call, budget)
        except ProxyError as err:
            self.refused("infer", err)
            call.state[REFUSED] = LocalReply.from_error(err)  # the data plane counts it
            return await infer(call, finish)
        try:  # a write that fails is the data plane's: it counts the call with it
            return await infer(call, self._writer(call, lease, finish))
        finally:
            lease.release()

    async def stream(self, call: Call, connection: Connection,
                     stream: Stream, serves: Callable[[str], bool], budget: Budget,
                     finish: Finish | None = None) -> AsyncGenerator[StreamItem, None]:
        """``infer`` for one request of a ``ModelStreamInfer`` stream: each response's outputs
        written into their regions (a later one overwrites, as Triton's do)."""
        if not serves(call.model):
            async for item in stream(call, finish):
                yield item
            return
        try:
            lease = await self._attach(self.client(connection), call, budget)
        except ProxyError as err:
            self.refused("infer", err)
            call.state[REFUSED] = LocalReply.from_error(err)  # the data plane counts it
            async for item in stream(call, finish):
                yield item
            return
        try:
            async for item in stream(call, self._writer(call, lease, finish)):
                yield item
        finally:
            lease.release()

    def _writer(self, call: Call, lease: Lease, finish: Finish | None) -> Finish:
        """``finish`` after the answer's outputs are written into their regions."""
        async def written(result: Result) -> None:
            if lease.outputs:
                try:
                    _write_outputs(call, result, lease)
                except ProxyError as err:
                    self.refused("infer", err)
                    raise
            if finish is not None:
                await finish(result)
        return written

    def _find(self, owner: int, what: str, params: dict[str, Any]) -> Region:
        name = params[REGION]
        region = self._regions.get((owner, name)) if isinstance(name, str) else None
        if region is None:
            raise ProxyError(ErrorKind.NOT_FOUND,
                             f"Unable to find shared memory region: '{name}' ({what}: none of "
                             "that name is registered by this client)")
        return region

    async def _attach(self, owner: int, call: Call, budget: Budget) -> Lease:
        """Pin the call's regions and read its inputs, once every bound is checked and the
        bytes to read, with the call's own, fit ``budget`` (a big read in a worker thread)."""
        lease = Lease()
        try:
            reads = [self._plan_input(owner, call, t, lease) for t in call.inputs
                     if REGION in t.parameters]
            for o in call.outputs:
                if REGION not in o.parameters:
                    continue
                what = f"output '{o.name}'"
                if o.parameters.get("binary_data"):
                    raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                                     "Output can't set both 'shared_memory_region' and "
                                     f"'binary_data' ({what})")
                region = self._find(owner, what, o.parameters)
                lease.outputs[o.name] = (region, *region.span(what, o.parameters))
                lease.pin(region)
            inline = sum(t.nbytes for t in call.inputs if REGION not in t.parameters)
            total = sum(size for _, _, _, size in reads) + inline
            if total > budget.limit:
                raise ProxyError(ErrorKind.TOO_LARGE,
                                 f"the request's inputs total {total} bytes with those in shared "
                                 f"memory; this listener accepts at most {budget.limit} bytes "
                                 f"({budget.setting})")
            request = (call.model, call.id)  # a BYTES input's framing: refused in Triton's words
            if total - inline > READ_INLINE_BYTES:
                await asyncio.to_thread(_read_inputs, reads, request)
            else:
                _read_inputs(reads, request)
        except ProxyError:
            lease.release()
            raise
        for o in call.outputs:
            o.parameters = {k: v for k, v in o.parameters.items() if k not in SHM_PARAMS}
        call.wire = None  # the backend gets the tensors inline, never the client's region names
        return lease

    def _plan_input(self, owner: int, call: Call, t: Tensor,
                    lease: Lease) -> tuple[Tensor, Region, int, int]:
        """The region, offset and size of an input, every bound checked; nothing read yet."""
        what = f"input '{t.name}'"
        region = self._find(owner, what, t.parameters)
        offset, size = region.span(what, t.parameters)
        width = itemsize(t.datatype)
        if width is not None and t.elements * width != size:
            raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                             f"[request id: {call.id or '<id_unknown>'}] input byte size "
                             f"mismatch for input '{t.name}' for model "
                             f"'{call.model}'. Expected {t.elements * width}, got {size} "
                             f"({t.datatype} shape {list(t.shape)}; shared_memory_byte_size "
                             f"in region '{region.name}')")
        lease.pin(region)
        return t, region, offset, size


def _read_inputs(reads: list[tuple[Tensor, Region, int, int]], request: tuple[str, str]) -> None:
    for t, region, offset, size in reads:
        t.raw = region.read(f"input '{t.name}'", offset, size)
        t.parameters = {k: v for k, v in t.parameters.items() if k not in SHM_PARAMS}
        t.check_payload(request)


def _write_outputs(call: Call, result: Result, lease: Lease) -> None:
    written = set()
    outputs = []
    for t in result.outputs:
        target = lease.outputs.get(t.name)
        if target is None:
            outputs.append(t)
            continue
        region, offset, size = target
        raw = memoryview(t.raw_bytes()).cast("B")
        if len(raw) > size:
            # Triton answers INTERNAL here too: the request was valid until the answer came.
            raise ProxyError(ErrorKind.INTERNAL,
                             f"shared memory size specified with the request for output "
                             f"'{t.name}' ({size} bytes, region '{region.name}') should be "
                             f"at least {len(raw)} bytes to hold the results")
        region.write(offset, raw)
        written.add(t.name)
        outputs.append(Tensor(t.name, t.datatype, t.shape, raw=b""))
    result.set_outputs(outputs)
    call.state[WRITTEN] = frozenset(written)


def _check_file(st: os.stat_result, name: str, key: str, owner: int, end: int) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                         f"region '{name}': {key} is not a regular file")
    if st.st_uid != owner:
        raise ProxyError(ErrorKind.PERMISSION_DENIED,
                         f"region '{name}': {key} belongs to uid {st.st_uid}, not to the "
                         f"client's uid {owner}; a client may only register its own shared "
                         "memory")
    if end > st.st_size:
        raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                         f"failed to register shared memory region '{name}': invalid args "
                         f"(offset + byte_size, {end}, is past the end of {key}, "
                         f"{st.st_size} bytes)")


def _loopback(host: str) -> bool:
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host == "localhost"
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback

