"""One pod, several worker processes: control state decided once, by the supervisor, read by all.

With ``mmguard serve --workers N`` (N > 1) the process that was started becomes the pod's
**supervisor** (``proxy.process.supervisor``): it owns the admin listener and the one authoritative
copy of every piece of *control state* — breakers, fault experiments and their stop windows, shadow
verdicts and robustness tables, router weights. The N **workers** serve the data listeners
(SO_REUSEPORT), each with its own event loop and backend connections, and keep a *replica* of that
state, which they read on the request path without any exchange.

A class whose state is control state derives from ``Shared`` and names each instance with a
pod-wide id (``share(obj, "breaker/<route>/<level>")``; every process builds the same objects
from the same config, so the ids agree). Its methods that change the state are marked:

- ``@decided``: an observation or an order. In a worker it is not run: it is forwarded to the
  supervisor (batched, once per loop turn), which runs it on its copy; in the supervisor and in
  a single process it simply runs. So a breaker opens, an experiment stops, a verdict aborts in
  one place, on the observations of every worker;
- ``@supervisor_only``: a decision the supervisor takes itself (from its own config, its
  admin API or its clock); in a worker it does nothing.

Whatever ran marks the object dirty; the supervisor then sends every worker the object's
``export_state()`` when it differs from what they last got (once per loop turn for all that
changed; within a few ms), and a worker's replica takes it with ``import_state()``. An export
holds what a replica reads on the request path (a breaker's state, not its window of outcomes;
an experiment's config and state, not its stop windows): the evidence stays with the supervisor,
whose admin API shows it, and an outcome that moved no decision sends nothing. Time-driven
moves (a breaker's wait in open ending, an experiment's duration) are the supervisor's
``tick()``, ten times a second. A worker that
(re)connects gets every object's state first: a restarted worker loses nothing.

In a single process (the default, ``--workers 1``) nothing here does anything: ``@decided``
runs the method, as before.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
import pickle
import struct
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger("mmguard.pod")

F = TypeVar("F", bound=Callable[..., Any])
_HEADER = struct.Struct("!I")
MAX_MESSAGE_BYTES = 256 << 20
"""A full state snapshot of a large pod stays far below this; a bigger frame is a bug."""


class Role(enum.Enum):
    SINGLE = "single"
    SUPERVISOR = "supervisor"
    WORKER = "worker"


class Shared:
    """Control state with one authoritative copy per pod (see the module's docstring)."""

    shared_id: str = ""

    def export_state(self) -> Any:
        """Everything a replica needs, picklable; no callbacks, clocks or metrics."""
        raise NotImplementedError

    def import_state(self, state: Any) -> None:
        """Take the supervisor's state (a worker's replica)."""
        raise NotImplementedError

    def tick(self) -> bool:
        """The supervisor's clock moved (10 Hz): any time-driven move; True when one happened."""
        return False


class Pod:
    """This process's place in the pod. One per process (``POD``)."""

    def __init__(self) -> None:
        self.role = Role.SINGLE
        self.index = 0
        """A worker's number, 0..workers-1 (0 elsewhere)."""
        self.workers = 1
        self._objects: dict[str, weakref.ref[Shared]] = {}
        self._outbox: list[tuple[str, str, tuple[Any, ...], dict[str, Any]]] = []
        self._send: Callable[[Any], None] | None = None
        """A worker's link to the supervisor (None until connected: ops wait in the outbox)."""
        self._dirty: set[str] = set()
        self._sent: dict[str, bytes] = {}
        """What the workers last got of each object: an unchanged export is not sent again."""
        self._flush_scheduled = False
        self.on_dirty: Callable[[], None] | None = None
        """The supervisor's broadcaster, told once per loop turn that something changed."""

    # --- every process ------------------------------------------------------------------------

    @property
    def is_worker(self) -> bool:
        return self.role is Role.WORKER

    def register(self, obj: Shared, shared_id: str) -> None:
        obj.shared_id = shared_id
        self._objects[shared_id] = weakref.ref(obj)
        if self.role is Role.SUPERVISOR:  # a new object (a reload built it): workers need it
            self.mark(shared_id)

    def objects(self) -> dict[str, Shared]:
        live = {}
        for key, ref in list(self._objects.items()):
            obj = ref()
            if obj is None:
                del self._objects[key]
            else:
                live[key] = obj
        return live

    def reset(self) -> None:
        """Back to a single process (tests)."""
        self.__init__()  # type: ignore[misc]

    # --- worker -------------------------------------------------------------------------------

    def forward(self, shared_id: str, method: str, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> None:
        self._outbox.append((shared_id, method, args, kwargs))
        if len(self._outbox) > 100_000:  # the supervisor is gone for long: keep the newest
            del self._outbox[:50_000]
            log.error("pod: 50000 observations dropped, the supervisor does not take them")
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if self._flush_scheduled or self._send is None:
            return
        self._flush_scheduled = True
        asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._send is None or not self._outbox:
            return
        ops, self._outbox = self._outbox, []
        self._send(("ops", ops))

    def connected(self, send: Callable[[Any], None] | None) -> None:
        self._send = send
        if send is not None and self._outbox:
            self._schedule_flush()

    def adopt(self, states: dict[str, Any]) -> None:
        """The supervisor's states, into this worker's replicas."""
        objects = self.objects()
        for key, state in states.items():
            obj = objects.get(key)
            if obj is not None:
                try:
                    obj.import_state(state)
                except Exception:  # one bad object must not stop the others' updates
                    log.exception("pod: cannot take the state of %s", key)

    # --- supervisor ---------------------------------------------------------------------------

    def mark(self, shared_id: str) -> None:
        if self.role is not Role.SUPERVISOR or not shared_id:
            return
        self._dirty.add(shared_id)
        if self.on_dirty is not None:
            self.on_dirty()

    def apply(self, ops: list[tuple[str, str, tuple[Any, ...], dict[str, Any]]]) -> int:
        """Run a worker's forwarded ops on this supervisor's copies; how many found no object
        (an id this config has no longer, e.g. right after a reload)."""
        objects = self.objects()
        missing = 0
        for shared_id, method, args, kwargs in ops:
            obj = objects.get(shared_id)
            if obj is None:
                missing += 1
                continue
            run = getattr(type(obj), method, None)
            target = getattr(run, "__pod_method__", None)
            if target is None:
                log.error("pod: %s.%s is not a @decided method", shared_id, method)
                continue
            try:
                target(obj, *args, **kwargs)
            except Exception:
                log.exception("pod: %s.%s failed", shared_id, method)
            self.mark(shared_id)
        return missing

    def take_dirty(self) -> dict[str, Any]:
        """The exports that changed since the workers last got them (an outcome that moved no
        decision changes nothing a replica reads: nothing is sent)."""
        objects = self.objects()
        dirty, self._dirty = self._dirty, set()
        changed = {}
        for key in dirty:
            if key not in objects:
                continue
            state = objects[key].export_state()
            frozen = pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
            if self._sent.get(key) != frozen:
                self._sent[key] = frozen
                changed[key] = state
        return changed

    def export_all(self) -> dict[str, Any]:
        return {k: obj.export_state() for k, obj in self.objects().items()}

    def tick(self) -> None:
        for key, obj in self.objects().items():
            try:
                if obj.tick():
                    self.mark(key)
            except Exception:
                log.exception("pod: tick of %s failed", key)


POD = Pod()


def share(obj: Shared, shared_id: str) -> None:
    """Name ``obj`` pod-wide (the same id in every process that builds it)."""
    POD.register(obj, shared_id)


def decided(method: F) -> F:
    """An observation or order: forwarded to the supervisor from a worker, run elsewhere."""

    @functools.wraps(method)
    def wrapper(self: Shared, *args: Any, **kwargs: Any) -> Any:
        if POD.role is Role.WORKER and self.shared_id:
            POD.forward(self.shared_id, method.__name__, args, kwargs)
            return None
        result = method(self, *args, **kwargs)
        POD.mark(self.shared_id)
        return result

    wrapper.__pod_method__ = method  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


def supervisor_only(method: F) -> F:
    """A decision the supervisor takes itself; a worker's replica does nothing."""

    @functools.wraps(method)
    def wrapper(self: Shared, *args: Any, **kwargs: Any) -> Any:
        if POD.role is Role.WORKER and self.shared_id:
            return None
        result = method(self, *args, **kwargs)
        POD.mark(self.shared_id)
        return result

    return wrapper  # type: ignore[return-value]


def permits_share(total: int) -> int:
    """This worker's part of ``total`` permits (a half-open breaker's probes), so the pod as a
    whole lets ``total`` through; all of them outside a pod."""
    n, i = POD.workers, POD.index
    return total // n + (1 if i < total % n else 0)


# --- the wire between a worker and its supervisor -------------------------------------------
# Length-prefixed pickles over a Unix socket in a directory only this user can open: both ends
# are the same program, the same user, in the same pod.


def encode(message: Any) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


async def read_message(reader: asyncio.StreamReader) -> Any:
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if size > MAX_MESSAGE_BYTES:
        raise ValueError(f"pod message of {size} bytes (limit {MAX_MESSAGE_BYTES})")
    return pickle.loads(await reader.readexactly(size))
