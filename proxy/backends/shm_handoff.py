"""Shared-memory hand-off to a co-located Triton (``shared_memory: system`` on a Triton backend).

Guards against paying for tensor bytes twice on the proxy→Triton hop of a sidecar whose pod
shares /dev/shm with Triton: mmguard writes a call's input tensors into one of its own registered
regions, asks Triton to write the outputs whose size it can know into the same region, and sends
only the small request message. Seed scenario: FP32 [1,3,224,224] at concurrency 16, where
Triton's CPU per request falls when it need not parse 600 KB messages.

What MUST hold:

- It never changes an answer. A call that does not fit a slot, finds no free slot, or carries
  something the hand-off does not handle (streams, classification, outputs whose size the
  contract cannot tell) goes inline, as without the hand-off; output bytes are copied out of the
  slot before the slot is reused.
- Slots are mmguard's own files (created exclusively, mode 0600), registered with Triton once,
  re-registered after Triton forgets them (a restart answers "Unable to find shared memory
  region": that call is sent again inline), unregistered and removed on close.
- Slot size comes from the live contracts (the largest fixed-size request plus answer at the
  model's max batch), within ``max_slot_bytes``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import mmap
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from google.protobuf.message import DecodeError
from prometheus_client import Counter, Gauge

from proxy.call import Call, Result, Target
from proxy.contract import ModelContract, TensorSpec
from proxy.errors import ErrorKind, ProxyError
from proxy.pb import grpc_service_pb2 as pb
from proxy.telemetry import Telemetry
from proxy.tensor import Tensor, element_count, itemsize
from proxy.wire import kserve_grpc, kserve_http, pbwire
from proxy.wire.answers import answer_source, check_outputs

log = logging.getLogger("mmguard.shm_handoff")

ALIGN = 64  # every tensor starts on a cache line
MIN_SLOT_BYTES = 64 * 1024
REGISTER_RETRY_S = 5.0
"""After Triton refused the slots, calls go inline without asking again for this long (not one
register round trip, and one warning, per call)."""
Register = Callable[[str, str, int], Awaitable[None]]
Unregister = Callable[[str], Awaitable[None]]
INLINE_REASONS = ("no_contract", "stream", "no_free_slot", "too_big", "slot_lost",
                  "unregistered")
"""Why a call went inline: no contract learned yet, a stream, every slot busy, tensors larger
than a slot, Triton had forgotten the slot (restart: sent again inline), slots not registered
(Triton refused them or /dev/shm is not shared)."""


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(eq=False)
class Slot:
    name: str
    key: str
    size: int
    path: Path
    mapping: mmap.mmap
    view: memoryview


@dataclass
class Plan:
    """Where one call's tensors go in a slot: inputs (name → offset, size) and the outputs
    Triton writes there (name → offset, size); ``inline_outputs`` come back in the answer."""

    slot: Slot
    generation: int = 0
    """The registration the slot was planned under (a late "unknown region" answer from
    before a re-registration must not forget the new one)."""
    inputs: dict[str, tuple[int, int]] = field(default_factory=dict)
    outputs: dict[str, tuple[int, int]] = field(default_factory=dict)
    inline_outputs: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


def contract_bytes(contract: ModelContract) -> int:
    """Bytes of the largest request plus answer the contract allows, counting only tensors of
    fixed size (a dynamic or BYTES tensor is sized by each call)."""
    batch = max(contract.max_batch_size, 1)
    total = 0
    for spec in (*contract.inputs, *contract.outputs):
        size = spec_bytes(spec, contract, batch)
        total += _aligned(size or 0)
    return total


def spec_bytes(spec: TensorSpec, contract: ModelContract, batch: int) -> int | None:
    width = itemsize(spec.datatype) if spec.datatype != "BYTES" else None
    dims = spec.dims[1:] if contract.max_batch_size > 0 and spec.dims else spec.dims
    if width is None or any(d < 0 for d in dims):
        return None
    lead = batch if contract.max_batch_size > 0 else 1
    return lead * element_count(tuple(dims)) * width


class HandoffMetrics:
    """A pool's counters on the admin ``/metrics``: the children of one backend, made at 0.

    Pools of the same backend name (a reload that changed the backend makes a new one) share
    the children, so counters go on and the slot gauges move by ``inc``/``dec``, never ``set``
    (the old pool may close after the new one registered)."""

    def __init__(self, telemetry: Telemetry, backend: str) -> None:
        m = telemetry.metric
        calls = m(Counter, "mmguard_shm_handoff_calls_total",
                  "Calls to Triton whose tensors went through a shared-memory slot.", ["backend"])
        inline = m(Counter, "mmguard_shm_handoff_inline_total",
                   "Calls to a hand-off backend sent with inline tensor bytes instead, by reason.",
                   ["backend", "reason"])
        rounds = m(Counter, "mmguard_shm_handoff_registrations_total",
                   "Rounds of registering the slots with Triton, by result (ok, failed).",
                   ["backend", "result"])
        lost = m(Counter, "mmguard_shm_handoff_reregistrations_total",
                 "Times Triton had forgotten the slots (it restarted): they are registered again.",
                 ["backend"])
        self.slots = m(Gauge, "mmguard_shm_handoff_slots",
                       "Shared-memory slots registered with Triton.", ["backend"]).labels(backend)
        self.in_use = m(Gauge, "mmguard_shm_handoff_slots_in_use",
                        "Slots holding a call in flight.", ["backend"]).labels(backend)
        self.slot_bytes = m(Gauge, "mmguard_shm_handoff_slot_bytes",
                            "Size of each slot, bytes (from the live contracts).",
                            ["backend"]).labels(backend)
        self.counters: dict[str, Any] = {"shm": calls.labels(backend),
                                         "register_ok": rounds.labels(backend, "ok"),
                                         "register_failed": rounds.labels(backend, "failed"),
                                         "reregister": lost.labels(backend)}
        for reason in INLINE_REASONS:
            self.counters[f"inline_{reason}"] = inline.labels(backend, reason)


class HandoffPool:
    """Slots for one backend. ``plan`` and ``release`` run on the event loop (no locks)."""

    def __init__(self, backend: str, slots: int, max_slot_bytes: int,
                 directory: Path = Path("/dev/shm"), retry_s: float = REGISTER_RETRY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.backend = backend
        self.slots_wanted = slots
        self.max_slot_bytes = max_slot_bytes
        self.directory = directory
        self.contracts: dict[str, ModelContract] = {}
        self.free: list[Slot] = []
        self.all: list[Slot] = []
        self._all_free: asyncio.Event | None = None  # what ``close`` waits for, when it must
        self.registered = False
        self.generation = 0  # +1 per successful registration round
        self.stats: dict[str, int] = {}
        self.metrics: HandoffMetrics | None = None
        self._setup = asyncio.Lock()
        self._retry_s, self._clock = retry_s, clock
        self._retry_at = 0.0  # no registration round before this (clock time)
        self._failing = False  # the last round failed: its warning is out already
        self._tag = f"mmguard_{backend}_{os.getpid()}_{secrets.token_hex(4)}"

    def bind(self, telemetry: Telemetry) -> None:
        """Count on ``telemetry``'s /metrics too (``stats`` keeps the same counts)."""
        self.metrics = HandoffMetrics(telemetry, self.backend)

    def count(self, what: str) -> None:
        self.stats[what] = self.stats.get(what, 0) + 1
        if self.metrics is not None:
            self.metrics.counters[what].inc()

    async def ensure(self, register: Register) -> bool:
        """Slots exist and Triton knows them; False (and the call goes inline) if that failed."""
        if self.registered:
            return True
        if self._clock() < self._retry_at:
            return False
        async with self._setup:
            if self.registered:
                return True
            if self._clock() < self._retry_at:  # the round this call waited for failed
                return False
            try:
                if not self.all:
                    self._create()
                for slot in self.all:
                    await register(slot.name, slot.key, slot.size)
            except Exception as exc:  # Triton refused or /dev/shm is not shared: stay inline
                self.count("register_failed")
                self._retry_at = self._clock() + self._retry_s
                (log.debug if self._failing else log.warning)(
                    "shared memory hand-off to backend '%s' is not available, tensors go "
                    "inline (registration tried again every %g s): %s", self.backend,
                    self._retry_s, exc)
                self._failing = True
                return False
            self.registered, self._failing = True, False
            self.generation += 1
            if self.metrics is not None:
                self.metrics.counters["register_ok"].inc()
                self.metrics.slots.inc(len(self.all))
                self.metrics.slot_bytes.set(self.all[0].size)
            log.info("shared memory hand-off to backend '%s': %d slots of %d bytes registered",
                     self.backend, len(self.all), self.all[0].size)
            return True

    def _create(self) -> None:
        need = max((contract_bytes(c) for c in self.contracts.values()), default=0)
        size = min(max(need, MIN_SLOT_BYTES), self.max_slot_bytes)
        for i in range(self.slots_wanted):
            name = f"{self._tag}_{i}"
            path = self.directory / name
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
            try:
                os.ftruncate(fd, size)
                mapping = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            slot = Slot(name, "/" + name, size, path, mapping, memoryview(mapping))
            self.all.append(slot)
            self.free.append(slot)

    def forget(self, generation: int | None = None) -> None:
        """Triton no longer knows the slots (it restarted): register them again next time.
        ``generation``: the registration the refused call was planned under; a refusal from an
        older one (answered after the slots were registered again) changes nothing."""
        if not self.registered or generation not in (None, self.generation):
            return
        self.registered = False
        self.count("reregister")
        if self.metrics is not None:
            self.metrics.slots.dec(len(self.all))

    def plan(self, call: Call, model: str) -> Plan | None:
        """A slot with the call's tensors placed, or None: send it inline."""
        contract = self.contracts.get(model)
        if contract is None or call.streaming:
            return self._inline("no_contract" if contract is None else "stream")
        if not self.free:
            return self._inline("no_free_slot")
        slot = self.free[-1]
        plan = Plan(slot, self.generation)
        offset = 0
        for t in call.inputs:
            size = len(t.raw_bytes())
            plan.inputs[t.name] = (offset, size)
            offset += _aligned(size)
        if offset > slot.size:
            return self._inline("too_big")
        batch = call.inputs[0].shape[0] if call.inputs and call.inputs[0].shape else 1
        for name, params in self._wanted_outputs(call, contract):
            spec = contract.output(name)
            out = None if spec is None or params else spec_bytes(spec, contract, batch)
            if out is not None and offset + out <= slot.size:
                plan.outputs[name] = (offset, out)
                offset += _aligned(out)
            else:
                plan.inline_outputs.append((name, params))
        self.free.pop()
        if self.metrics is not None:
            self.metrics.in_use.inc()
        for t in call.inputs:
            start, n = plan.inputs[t.name]
            slot.view[start:start + n] = memoryview(t.raw_bytes()).cast("B")
        self.count("shm")
        return plan

    @staticmethod
    def _wanted_outputs(call: Call, contract: ModelContract) -> Iterable[tuple[str, dict[str,
                                                                                       Any]]]:
        if call.outputs:  # what the client asked, with its own parameters (minus the framing)
            return [(o.name, {k: v for k, v in o.parameters.items() if k != "binary_data"})
                    for o in call.outputs]
        return [(spec.name, {}) for spec in contract.outputs]

    def _inline(self, why: str) -> Plan | None:
        self.count(f"inline_{why}")
        return None

    def read(self, plan: Plan, name: str, nbytes: int) -> bytes:
        """An output Triton wrote, copied out (the slot is reused after ``release``)."""
        start, size = plan.outputs[name]
        if nbytes > size:
            raise ValueError(f"output '{name}' is {nbytes} bytes, its slot space {size}")
        return bytes(plan.slot.view[start:start + nbytes])

    def release(self, plan: Plan) -> None:
        self.free.append(plan.slot)
        if self._all_free is not None and len(self.free) == len(self.all):
            self._all_free.set()
        if self.metrics is not None:
            self.metrics.in_use.dec()

    async def close(self, unregister: Unregister, within_s: float = 0.0) -> None:
        """Unregister and unmap every slot, once the calls using them are done (a reload
        retired the backend under them), ``within_s`` at most."""
        if len(self.free) < len(self.all) and within_s > 0:
            self._all_free = asyncio.Event()
            try:
                await asyncio.wait_for(self._all_free.wait(), within_s)
            except TimeoutError:
                pass
        if self.registered:
            for slot in self.all:
                try:
                    await unregister(slot.name)
                except Exception as exc:  # Triton may be gone already; the files go anyway
                    log.debug("unregister %s: %s", slot.name, exc)
            if self.metrics is not None:
                self.metrics.slots.dec(len(self.all))
        self.registered = False
        for slot in self.all:
            slot.view.release()
            slot.mapping.close()
            try:
                slot.path.unlink()
            except FileNotFoundError:
                pass
        self.all.clear()
        self.free.clear()


# --- Triton over gRPC -----------------------------------------------------------------------------

Send = Callable[[bytes], Awaitable[bytes]]
A = TypeVar("A")


async def grpc_infer(pool: HandoffPool, call: Call, target: Target, send: Send,
                     register: Register) -> Result | None:
    """The call through a slot, or None: the caller sends it inline (nothing was sent, or
    Triton had forgotten the slot and nothing was computed)."""
    source = answer_source(pool.backend, target.model)
    return await _through_slot(
        pool, call, target, register, lambda plan: send(_grpc_request(call, target, plan)),
        lambda plan, answer: _grpc_result(pool, plan, answer, source))


async def _through_slot(pool: HandoffPool, call: Call, target: Target, register: Register,
                        send: Callable[[Plan], Awaitable[A]],
                        read: Callable[[Plan, A], Result]) -> Result | None:
    """``send`` the call with its tensors in a slot and ``read`` the answer; None when no slot
    is ready or fits, or when Triton had forgotten the slot ("Unable to find shared memory
    region: '...'": nothing was computed, so the caller sends inline)."""
    if not await pool.ensure(register):
        pool.count("inline_unregistered")
        return None
    plan = pool.plan(call, target.model)
    if plan is None:
        return None
    try:
        try:
            answer = await send(plan)
        except ProxyError as err:
            if plan.slot.name in err.message:
                pool.forget(plan.generation)
                pool.count("inline_slot_lost")
                return None
            raise
        return read(plan, answer)
    finally:
        pool.release(plan)


def _grpc_request(call: Call, target: Target, plan: Plan) -> bytes:
    req = pb.ModelInferRequest(model_name=target.model, model_version=target.version,
                               id=call.id)
    kserve_grpc.params_to_pb(req.parameters, call.parameters)
    for t in call.inputs:
        inp = req.inputs.add(name=t.name, datatype=t.datatype, shape=t.shape)
        offset, size = plan.inputs[t.name]
        params = {k: v for k, v in t.parameters.items() if k != "binary_data_size"}
        kserve_grpc.params_to_pb(inp.parameters, {**params, **_region(plan, offset, size)})
    for name, (offset, size) in plan.outputs.items():
        out = req.outputs.add(name=name)
        kserve_grpc.params_to_pb(out.parameters, _region(plan, offset, size))
    for name, params in plan.inline_outputs:  # e.g. classification: Triton's answer, inline
        out = req.outputs.add(name=name)
        kserve_grpc.params_to_pb(out.parameters, params)
    return bytes(req.SerializeToString())


def _region(plan: Plan, offset: int, size: int) -> dict[str, Any]:
    return {"shared_memory_region": plan.slot.name, "shared_memory_offset": offset,
            "shared_memory_byte_size": size}


def _grpc_result(pool: HandoffPool, plan: Plan, answer: bytes, source: str) -> Result:
    resp = pb.ModelInferResponse()
    try:
        head, raws = pbwire.split(answer, 6)  # raw_output_contents
        resp.ParseFromString(head)
    except (DecodeError, pbwire.WireError) as exc:
        raise ProxyError(ErrorKind.BAD_GATEWAY, f"{source} sent a malformed ModelInferResponse: "
                         f"{exc}", origin="backend") from None
    # Triton keeps one raw entry per output (empty for an output it wrote into shared memory).
    aligned, inline = len(raws) == len(resp.outputs), iter(raws)
    outputs = []
    for i, o in enumerate(resp.outputs):
        if aligned:
            raw: bytes | memoryview = raws[i]
        else:
            raw = b"" if o.name in plan.outputs else next(inline, b"")
        t = Tensor(o.name, o.datatype, tuple(o.shape), raw=raw,
                   parameters=kserve_grpc.params_from_pb(o.parameters))
        if o.name in plan.outputs:
            width = itemsize(o.datatype)
            nbytes = t.elements * (width or 0)
            try:
                t.raw = pool.read(plan, o.name, nbytes)
            except ValueError as exc:
                raise ProxyError(ErrorKind.BAD_GATEWAY, f"{source}: {exc}",
                                 origin="backend") from None
        outputs.append(t)
    check_outputs(outputs, source)  # the same contract check as an inline answer's
    return Result(resp.model_name, resp.model_version, resp.id, outputs,
                  parameters=kserve_grpc.params_from_pb(resp.parameters))


# --- Triton over HTTP -----------------------------------------------------------------------------

PostInfer = Callable[[bytes, int | None], Awaitable[tuple[bytes, str | None]]]


async def http_infer(pool: HandoffPool, call: Call, target: Target, post: PostInfer,
                     register: Register) -> Result | None:
    """As ``grpc_infer``, over Triton's HTTP API (a JSON-only request: no tensor bytes)."""
    source = answer_source(pool.backend, target.model)
    return await _through_slot(
        pool, call, target, register, lambda plan: post(_http_request(call, plan), None),
        lambda plan, answer: _http_result(pool, plan, answer[0], answer[1], source))


def _http_request(call: Call, plan: Plan) -> bytes:
    head: dict[str, Any] = {"inputs": [], "outputs": []}
    if call.id:
        head["id"] = call.id
    params = {k: v for k, v in call.parameters.items() if k != "binary_data_output"}
    if params:
        head["parameters"] = params
    for t in call.inputs:
        offset, size = plan.inputs[t.name]
        own = {k: v for k, v in t.parameters.items() if k != "binary_data_size"}
        head["inputs"].append({"name": t.name, "datatype": t.datatype, "shape": list(t.shape),
                               "parameters": {**own, **_region(plan, offset, size)}})
    for name, (offset, size) in plan.outputs.items():
        head["outputs"].append({"name": name, "parameters": _region(plan, offset, size)})
    for name, out_params in plan.inline_outputs:
        head["outputs"].append({"name": name, "parameters": {**out_params, "binary_data": True}})
    return json.dumps(head, separators=(",", ":")).encode()


def _http_result(pool: HandoffPool, plan: Plan, body: bytes, header_length: str | None,
                 source: str) -> Result:
    try:
        doc, hlen = kserve_http.split_body(body, header_length, "response")
    except ProxyError as err:
        raise ProxyError(ErrorKind.BAD_GATEWAY, f"{source} sent a malformed v2 response: {err}",
                         origin="backend") from None
    view, offset, outputs = memoryview(body), hlen or 0, []
    for o in doc.get("outputs") or []:
        params = dict(o.get("parameters") or {})
        size = params.pop("binary_data_size", None)
        t = Tensor(o["name"], o["datatype"], tuple(o.get("shape") or ()), raw=b"",
                   parameters=params)
        if o["name"] in plan.outputs:
            try:
                t.raw = pool.read(plan, t.name, t.elements * (itemsize(t.datatype) or 0))
            except ValueError as exc:
                raise ProxyError(ErrorKind.BAD_GATEWAY, f"{source}: {exc}",
                                 origin="backend") from None
        elif size is not None:
            t.raw = view[offset:offset + size]
            offset += size
        else:
            t.raw, t.data = None, o.get("data", [])
            t.raw = t.to_raw()
        outputs.append(t)
    check_outputs(outputs, source)
    return Result(str(doc.get("model_name", "")), str(doc.get("model_version", "")),
                  str(doc.get("id", "")), outputs, parameters=dict(doc.get("parameters") or {}))
