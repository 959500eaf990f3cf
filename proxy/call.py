"""The protocol-neutral request (``Call``), its answer (``Result``) and a refusal (``LocalReply``).

A front decodes its wire request into a ``Call``; filters read and edit it; the terminal hands it
to a backend. Rules that MUST hold:

- Per-request state lives on the call under typed keys (``CallKey``), never on a filter object.
- ``Call.wire`` / ``Result.wire`` hold the original encoded message while nothing has edited the
  inputs/outputs. Any edit goes through ``set_inputs`` / ``set_outputs``, which drops the wire form,
  so an edited call is re-encoded and an unedited one is forwarded byte for byte.
- ``Call.decisions`` are the ``mmguard-*`` annotations that filters make (see
  ``Telemetry.decide``): the fronts send them as HTTP response headers or gRPC trailing metadata,
  whether the answer is a result or a refusal.
"""

from __future__ import annotations

import enum
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

from proxy.errors import ErrorKind, ProxyError, bounded, kind_from_http
from proxy.keys import BaseKey, Store
from proxy.tensor import Tensor

T = TypeVar("T")


class CallKey(BaseKey[T]):
    """A typed key for per-request state: ``call.state[KEY]`` is a ``T``."""

    __slots__ = ()


class Api(enum.Enum):
    """Which API a call speaks, and a backend serves: the one test of it (a call's ``document``,
    a backend's or a wire's ``protocol`` say it only indirectly)."""

    KSERVE_V2 = "kserve_v2"
    OPENAI = "openai"


def headers_match(want: Mapping[str, str], have: Mapping[str, str]) -> bool:
    """Every header in ``want`` is in ``have`` (a call's headers: lower-case names) with that
    value, ``"*"`` matching any value. What canary membership, experiments and mirroring use."""
    return all((got := have.get(name.lower())) is not None and (value == "*" or got == value)
               for name, value in want.items())


# The one standard key the runtime sets (keys filters share among themselves: filters/call_keys.py).
CANARY: CallKey[bool] = CallKey("canary")
"""Set for every call by the runtime: the call is canary traffic (``Config.canary``); what acts
on canary traffic only (experiments, verdicts) tests this one flag."""
SCORES: CallKey[dict[str, float]] = CallKey("scores")
"""Scores filters published on the call (``publish_scores``), by ``<filter>.<score>`` (e.g.
``quality.alignment``): what ``canary.eligible`` judges."""
CANARY_ELIGIBLE: CallKey[bool] = CallKey("canary_eligible")
"""Set only where ``canary.eligible`` is configured: False until the published scores meet it.
Only an eligible call enters the canary share or the shadow's mirrored share."""
CANARY_POPULATION: CallKey[str] = CallKey("canary_population")
"""Where ``canary.eligible`` is configured: the population it admits, in words (for verdicts)."""
CANARY_GATE: CallKey[Callable[[Call], None]] = CallKey("canary_gate")
"""The runtime's eligibility check, run by ``publish_scores``."""


def publish_scores(call: Call, scores: Mapping[str, float]) -> None:
    """Publish scores on the call (``SCORES``); where canary eligibility is configured, the
    call is judged on them now, so the filters after this one see its final membership."""
    have = call.state.get(SCORES)
    if have is None:
        call.state[SCORES] = have = {}
    have.update(scores)
    gate = call.state.get(CANARY_GATE)
    if gate is not None:
        gate(call)

def document_copy(value: Any) -> Any:
    """A copy of an OpenAI document that a copy of the call may edit without touching the
    original: every dict and list is new, the leaves (strings, numbers) are shared — they cannot
    change. Equal to ``json.loads(json.dumps(value))`` for a parsed document (a tuple becomes a
    list, as JSON makes it), without re-encoding its text: a data: URL image of 500 KB took
    ~3 ms through JSON and takes ~5 µs here."""
    if isinstance(value, dict):
        return {k: document_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [document_copy(v) for v in value]
    return value


class StreamMemory:
    """What filters keep from the requests of one client stream (gRPC ``ModelStreamInfer``) for
    the stream's later requests: a video's previous frames, for ``quality``'s residue.

    A stream is one client's: a mesh or a gateway proxies it as one stream, where a keep-alive
    connection may carry many clients' requests one after another. So what a stream keeps can
    only ever be compared with that client's own requests. Each entry may come with a
    ``release`` (giving back what a process-wide budget lent it); the front closes the memory
    when the stream ends, and every release runs then."""

    __slots__ = ("_closed", "_kept", "owner")

    def __init__(self, owner: str = "the stream") -> None:
        self._kept: dict[str, tuple[Any, Callable[[], None] | None]] = {}
        self._closed = False
        self.owner = owner
        """Whose requests these are, in words for messages: "the stream", "the client"."""

    def get(self, key: str) -> Any:
        found = self._kept.get(key)
        return None if found is None else found[0]

    def put(self, key: str, value: Any, release: Callable[[], None] | None = None) -> None:
        """Keep ``value`` under ``key``, releasing what it replaces (once the stream ended,
        nothing is kept: ``value`` is released at once)."""
        old = self._kept.pop(key, None)
        if old is not None and old[1] is not None:
            old[1]()
        if not self._closed:
            self._kept[key] = (value, release)
        elif release is not None:
            release()

    def close(self) -> None:
        """Forget everything, releasing each entry (the stream ended); idempotent."""
        self._closed = True
        kept, self._kept = self._kept, {}
        for _, release in kept.values():
            if release is not None:
                release()


STREAM_MEMORY: CallKey[StreamMemory] = CallKey("stream_memory")
"""Set by the gRPC front on every request of a ``ModelStreamInfer`` stream: that stream's
memory; on a unary call, the memory of its client where its listener names a header that says
who the client is (``listeners.*.client_header``, set by a trusted gateway); absent otherwise
(mmguard cannot tell one client's unary requests from the next client's)."""


TREATMENT: CallKey[set[str]] = CallKey("treatment")
"""The names of the call's decision headers that reveal its treatment (mirrored to a canary, a
fault injected): ``Telemetry.decide(..., treatment=True)`` records them. A client must not learn
its treatment unless its listener shows it (``SHOW_TREATMENT``): membership is what makes
steering a canary verdict cheap."""
SHOW_TREATMENT: CallKey[bool] = CallKey("show_treatment")
"""Set by the runtime from the call's listener (``listeners.*.treatment_headers``)."""
REFUSED: CallKey[LocalReply] = CallKey("refused")
"""A refusal made before the call's route runs (its shared-memory tensors cannot be used): the
data plane gives it as the call's answer, so it is counted and traced like any other."""
CLIENT_DEADLINE: CallKey[float] = CallKey("client_deadline")
"""The deadline the client asked for (``mmguard-timeout-ms``, a gRPC deadline), as the front
set it, before any route or level timeout narrowed it; absent without one. A timeout under a
deadline the client chose short is the client's doing, not the backend failing."""
ANSWERED_BY: CallKey[str] = CallKey("answered_by")
"""Who answered, when it was not the route's own model: a lighter route's backend (fallback's
L2), ``(cache)`` or ``(static)`` (its L3). The call is counted under that backend in
``mmguard_requests_total``, and the route's model statistics count no execution for it."""
BACKEND_S: CallKey[float] = CallKey("backend_s")
"""Seconds the call spent waiting on its backends' unary answers, summed over every try (the
terminal adds each one); absent for a stream and for a call no backend was asked. What a
canary's latency is judged on: the model's time, not the proxy's own path to it."""
BACKEND_TIMED_S: CallKey[float] = CallKey("backend_timed_s")
"""Set by a backend that times its own work off the event loop (in-process ONNX Runtime: from
the call's hand-over to its thread pool until the run ended, read in the worker thread). The
terminal prefers it to its own time around the await, which also holds the wait for the event
loop to resume the call: on a busy machine, mmguard's scheduling, not the model's."""


@dataclass(slots=True)
class Wire:
    """An encoded message as it came: ``protocol`` is ``grpc`` (protobuf bytes) or ``http``
    (a v2 JSON body, with ``header_length`` for the binary extension)."""

    protocol: str
    body: bytes
    header_length: int | None = None
    content_type: str | None = None
    head: dict[str, Any] | None = None
    """An HTTP answer's JSON head as parsed when it came (never edited): a renamed route's
    answer is rewritten from it without parsing the head again."""

    @property
    def api(self) -> Api:
        return Api.OPENAI if self.protocol == "openai" else Api.KSERVE_V2


@dataclass(slots=True)
class RequestedOutput:
    name: str
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Target:
    """Where the terminal sends the call: a backend by name and the model name it knows."""

    backend: str
    model: str
    version: str = ""


@dataclass(slots=True, eq=False)
class Call:
    model: str
    version: str
    inputs: list[Tensor]
    id: str = ""
    outputs: list[RequestedOutput] = field(default_factory=list)
    parameters: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)  # client metadata, lower-case keys
    front: str = ""  # grpc | http
    streaming: bool = False
    deadline: float | None = None  # time.monotonic() by which the answer is due
    wire: Wire | None = None
    document: dict[str, Any] | None = None  # OpenAI requests: the parsed JSON body
    # OpenAI requests: /v1/chat/completions, /v1/completions; v2 HTTP: generate or
    # generate_stream ("": infer)
    endpoint: str = ""
    target: Target | None = None
    state: Store = field(default_factory=Store)
    decisions: dict[str, str] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)

    def shown_decisions(self) -> dict[str, str]:
        """The decisions the client may see: every one, less the treatment headers when its
        listener does not show treatment. What every front sends, never ``decisions`` itself."""
        hidden = self.state.get(TREATMENT)
        if not hidden or self.state.get(SHOW_TREATMENT):
            return self.decisions
        return {k: v for k, v in self.decisions.items() if k not in hidden}

    def set_inputs(self, inputs: list[Tensor]) -> None:
        self.inputs = inputs
        self.wire = None

    def input(self, name: str) -> Tensor | None:
        for t in self.inputs:
            if t.name == name:
                return t
        return None

    @property
    def api(self) -> Api:
        """OpenAI when the call came as an OpenAI document, else KServe v2."""
        return Api.OPENAI if self.document is not None else Api.KSERVE_V2

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.inputs)

    def remaining(self) -> float | None:
        """Seconds left before the deadline (may be negative), or None without one."""
        return None if self.deadline is None else self.deadline - time.monotonic()


class Decoded(NamedTuple):
    model: str
    version: str
    id: str
    parameters: dict[str, Any]
    outputs: list[Tensor]


class Result:
    """A backend's answer. Built from its wire form, it is decoded only when someone reads a
    field: an answer forwarded unchanged to a client of the same protocol is never parsed."""

    __slots__ = ("_decode", "_decoded", "encoded", "stream", "wire")

    def __init__(self, model: str = "", version: str = "", id: str = "",
                 outputs: list[Tensor] | None = None, *, parameters: dict[str, Any] | None = None,
                 wire: Wire | None = None, decode: Callable[[], Decoded] | None = None,
                 stream: AsyncIterator[StreamItem] | None = None) -> None:
        self.wire = wire
        self.stream = stream
        self.encoded: bytes | None = None
        """The answer as its front sends it, made by the front's last step (``Finish``)
        before the call is counted."""
        self._decode = decode
        self._decoded: Decoded | None = None if decode is not None else Decoded(
            model, version, id, parameters or {}, outputs or [])

    def _fields(self) -> Decoded:
        if self._decoded is None:
            assert self._decode is not None
            self._decoded = self._decode()
        return self._decoded

    @property
    def model(self) -> str:
        return self._fields().model

    @property
    def version(self) -> str:
        return self._fields().version

    @property
    def id(self) -> str:
        return self._fields().id

    @property
    def parameters(self) -> dict[str, Any]:
        return self._fields().parameters

    @property
    def outputs(self) -> list[Tensor]:
        return self._fields().outputs

    def set_outputs(self, outputs: list[Tensor]) -> None:
        self._decoded = self._fields()._replace(outputs=outputs)
        self.wire = None

    def output(self, name: str) -> Tensor | None:
        for t in self.outputs:
            if t.name == name:
                return t
        return None


@dataclass(slots=True)
class LocalReply:
    """A refusal made by mmguard (or a backend error), encoded by the front through ONE table."""

    kind: ErrorKind
    message: str
    origin: str = "mmguard"
    retry_after_s: float | None = None
    status: int | None = None  # a backend's own HTTP status, kept when passing its error on
    body: bytes | None = None  # a backend's own error body (same protocol only)
    param: str | None = None  # the request field at fault, for OpenAI-shaped errors
    injected: str | None = None  # "<experiment>/<action>" when a fault experiment made it
    reset: bool = False  # injected "connection reset": HTTP fronts drop the connection

    def __post_init__(self) -> None:
        self.message = bounded(self.message)  # the same bound as ProxyError's

    @property
    def dropped_by_backend(self) -> bool:
        """A CANCELLED the backend made: it dropped a call it had taken (Triton cancels its
        in-flight requests as it shuts down). The client's own leaving cancels the call's task
        instead; it never comes back as a reply."""
        return self.kind is ErrorKind.CANCELLED and self.origin == "backend"

    @classmethod
    def from_error(cls, err: ProxyError) -> LocalReply:
        return cls(err.kind, err.message, origin=err.origin, retry_after_s=err.retry_after_s,
                   status=err.status, body=err.body, param=err.param)


Finish = Callable[[Result], Awaitable[None]]
"""A front's last step on an answer before its client gets it (encoding it, writing its outputs
into shared memory). The data plane runs it before it counts the call: whatever it raises is
what the client gets, and so what the metric and the span say."""


@dataclass(slots=True)
class SseEvent:
    """One server-sent event exactly as the backend sent it (``data: ...`` plus the blank line);
    parsed only when someone asks."""

    raw: bytes
    more: bool = False
    """What follows this event is already here (another event of the same backend read, or
    the stream's end): a writer may hold this one and send it with what follows in one write
    (one syscall for what arrived in one). An event a filter makes says False."""

    @property
    def data(self) -> bytes:
        lines = [ln[5:].lstrip(b" ") for ln in self.raw.splitlines() if ln.startswith(b"data:")]
        return b"\n".join(lines)

    @property
    def done(self) -> bool:
        return self.data.strip() == b"[DONE]"

    def json(self) -> dict[str, Any] | None:
        try:
            doc = json.loads(self.data)
        except ValueError:
            return None
        return doc if isinstance(doc, dict) else None


@dataclass(slots=True)
class SseEvents:
    """The complete events one backend read brought, in order, each exactly as the backend sent
    it: what a front that handles a stream read by read sends in one write (``SseStream.reads``).
    Filters never see one: they read a stream event by event."""

    raws: list[bytes]
    ended: bool = False
    """The same read also brought the stream's end: a writer may send these events with the
    end of its own answer in one write."""


Reply = Result | LocalReply
StreamItem = Result | LocalReply | SseEvent | SseEvents


def stream_error(item: StreamItem) -> LocalReply | None:
    """The failure an OpenAI error event among ``item``'s events says (``data: {"error":
    {...}}``: what vLLM sends when a stream fails after its head, its engine dead), or None.
    The client gets the event as it came; the call failed all the same."""
    raws = (item.raws if isinstance(item, SseEvents) else
            (item.raw,) if isinstance(item, SseEvent) else ())
    for raw in raws:
        if b'"error"' not in raw:
            continue
        doc = SseEvent(raw).json()
        err = doc.get("error") if doc is not None else None
        if isinstance(err, dict):
            code = err.get("code")
            kind = (kind_from_http(code) if type(code) is int and 400 <= code < 600
                    else ErrorKind.INTERNAL)
            return LocalReply(kind, str(err.get("message", "")), origin="backend")
    return None


class SseStream:
    """A backend's server-sent events, read one way or the other (not both):

    - ``async for``: one ``SseEvent`` at a time, ``more`` set while what follows came in the same
      read; what filters wrap and see, and what a traced stream reads;
    - ``reads()``: one ``SseEvents`` per backend read, for a front that sends what a read brought
      in one write and needs no event on its own (no per-event item to make and hand through
      the data plane's layers: the larger part of a streamed answer's own cost in mmguard).

    A failure is a ``LocalReply`` item or an exception, either way."""

    __slots__ = ("_queue", "_reads")

    def __init__(self, reads: AsyncGenerator[SseEvents | LocalReply, None]) -> None:
        self._reads = reads
        self._queue: list[SseEvent] = []  # the rest of the last read, reversed

    def reads(self) -> AsyncGenerator[SseEvents | LocalReply, None]:
        return self._reads

    def __aiter__(self) -> SseStream:
        return self

    async def __anext__(self) -> SseEvent | LocalReply:
        if self._queue:
            return self._queue.pop()
        item = await anext(self._reads)  # StopAsyncIteration: the stream ended
        while isinstance(item, SseEvents) and not item.raws:
            item = await anext(self._reads)
        if not isinstance(item, SseEvents):
            return item
        last = len(item.raws) - 1
        self._queue = [SseEvent(raw, more=i < last or item.ended)
                       for i, raw in enumerate(item.raws)][::-1]
        return self._queue.pop()

    async def aclose(self) -> None:
        self._queue = []
        await self._reads.aclose()
