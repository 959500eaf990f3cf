"""The data plane both fronts share: health, metadata, statistics, the repository API and
inference over the current runtime, with the request-level span, metrics and statistics done
once, here, for every front.

Unknown-model refusals never list the served models: any client may ask, and the list is the
operator's (it stays in mmguard's log and on the admin port).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Span

from proxy import __version__
from proxy.backends.base import Backend
from proxy.call import (
    ANSWERED_BY,
    CANARY,
    REFUSED,
    Api,
    Call,
    Finish,
    LocalReply,
    Reply,
    Result,
    SseStream,
    StreamItem,
    stream_error,
)
from proxy.contract import ModelContract
from proxy.engine.runtime import Route, Runtime
from proxy.errors import (
    STATUS,
    ErrorKind,
    ProxyError,
    cancelled_under,
    model_version,
    unknown_model,
    unknown_model_statistics,
)
from proxy.lifecycle import StateKey
from proxy.telemetry import RequestMetrics, Telemetry, end_server_span, server_span, tracing_on

EXTENSIONS = ("classification", "binary_tensor_data", "statistics", "model_configuration")
MMGUARD_EXTENSION = "mmguard"
"""Announces mmguard in a backend's server metadata (``v2.server_metadata: backend``)."""
_REFUSED_EXTENSIONS = frozenset({"cuda_shared_memory", "trace", "logging"})
"""Backend extensions mmguard answers with a refusal: not announced on its behalf."""
_REFUSALS = {
    "trace": "trace settings are mmguard's own config (telemetry.otlp_endpoint), and a "
             "backend's are the backend's operator's: mmguard neither serves nor forwards them",
    "logging": "log settings are mmguard's own config (telemetry.log_level), and a backend's "
               "are the backend's operator's: mmguard neither serves nor forwards them",
}


def refused_extension(extension: str) -> ProxyError:
    """The one refusal of a v2 extension mmguard does not serve (``trace``, ``logging``), the
    same text on both fronts; the server metadata does not announce these extensions."""
    return ProxyError(ErrorKind.UNIMPLEMENTED,
                      f"the '{extension}' extension is not served by mmguard: "
                      f"{_REFUSALS[extension]}")
_REPOSITORY_EXTENSIONS = frozenset({"model_repository", "model_repository(unload_dependents)"})
_tracer = trace.get_tracer("mmguard")
log = logging.getLogger("mmguard.dataplane")
_CONTRACTS_CHECKED: StateKey[set[tuple[str, str]]] = StateKey("v2_contracts_checked")
"""(route, contract fingerprint) already checked for servability (said once per process)."""


@dataclass
class ModelStats:
    success_count: int = 0
    success_ns: int = 0
    fail_count: int = 0
    fail_ns: int = 0
    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0


class DataPlane:
    def __init__(self, runtime: Runtime, telemetry: Telemetry) -> None:
        self.runtime = runtime
        self.telemetry = telemetry
        self.stats: dict[str, ModelStats] = {}
        self.draining = False
        self.ready_override: Callable[[], bool] | None = None
        """A pod's supervisor: ready when its workers are (it serves no data itself)."""
        self.readiness_override: Callable[[], dict[str, Any]] | None = None
        """A pod's supervisor: its workers' backends and routes, and why not ready."""

    # --- health and metadata ----------------------------------------------------------------

    def live(self) -> bool:
        return True

    async def ready(self) -> bool:
        if self.ready_override is not None:
            return not self.draining and self.ready_override()
        ready = await self.runtime.ready()
        # After the await: a contract that arrived while readiness was polled is checked on
        # this pass, so "ready" never comes before the error saying a route cannot work.
        self._check_contracts()
        return not self.draining and ready

    def readiness(self) -> dict[str, Any]:
        """Each backend and route, ready or not and why (for a pod's supervisor, as its
        workers told it)."""
        if self.readiness_override is not None:
            return self.readiness_override()
        return self.runtime.readiness()

    async def model_ready(self, model: str, version: str = "") -> bool:
        version = model_version(version)
        if model not in self.runtime.served or self._unservable(model) is not None:
            return False
        return not self.draining and await self.runtime.model_ready(model, version)

    def _unservable(self, model: str) -> str | None:
        """Why a route cannot be served whatever the request (None: it can)."""
        route = self.runtime.routes.get(model)
        return None if route is None else self._route_unservable(route)

    def _route_unservable(self, route: Route) -> str | None:
        contract = self.runtime.contracts.get(route.name)
        if contract is None or not contract.decoupled:
            return None
        backend = self.runtime.backends[route.spec.backend]
        if backend.protocol != "http":
            return None
        return (f"model '{route.name}' (route '{route.name}', backend '{route.spec.backend}' "
                f"model '{route.target.model}') is decoupled, and Triton streams decoupled "
                f"models over gRPC only: a triton_http backend cannot serve it; route it to a "
                f"triton_grpc backend")

    def _check_contracts(self) -> None:
        """Say once, when a contract is learned, that its route cannot work (readiness is
        polled every half second, so this is within that of the contract's arrival)."""
        seen = self.runtime.state.setdefault(_CONTRACTS_CHECKED, set)
        for model, contract in self.runtime.contracts.items():
            key = (model, contract.fingerprint)
            if key in seen:
                continue
            seen.add(key)
            why = self._unservable(model)
            if why is not None:
                log.error("config: %s", why, extra={"fields": {"route": model}})

    async def server_metadata(self) -> tuple[dict[str, Any], str]:
        """The server metadata to answer, and what it is (for the ``mmguard-server-metadata``
        header): the backend's (``v2.server_metadata: backend``) or mmguard's own."""
        config = self.runtime.config
        own: dict[str, Any] = {"name": "mmguard", "version": __version__,
                               "extensions": list(EXTENSIONS)}
        if config.v2.repository_api:
            own["extensions"] += sorted(_REPOSITORY_EXTENSIONS)
        name = config.v2_backend()
        if config.v2.server_metadata == "mmguard" or name is None:
            return own, "mmguard"
        try:
            meta = await self.runtime.backends[name].server_metadata()
        except ProxyError as err:
            return own, f"mmguard (backend '{name}' did not answer: {err.message[:200]})"
        if meta is None:
            return own, "mmguard"
        refused = _REFUSED_EXTENSIONS | (set() if config.v2.repository_api
                                         else _REPOSITORY_EXTENSIONS)
        extensions = [e for e in meta.get("extensions", []) if e not in refused]
        return ({"name": str(meta.get("name", "")), "version": str(meta.get("version", "")),
                 "extensions": [*extensions, MMGUARD_EXTENSION]}, f"backend '{name}'")

    def repository_backend(self, rpc: str, authorization: str | None) -> Backend:
        """The backend a repository call goes to, once the switch and the token allow it."""
        config = self.runtime.config
        if not config.v2.repository_api:
            raise ProxyError(ErrorKind.UNIMPLEMENTED,
                             f"{rpc}: the model repository API is off in mmguard "
                             f"(v2.repository_api: false); load and unload models on the model "
                             f"server, or turn it on (it then needs the admin token)")
        digest = config.listeners.admin._token_digest
        scheme, _, token = (authorization or "").partition(" ")
        given = hashlib.sha256(token.strip().encode()).hexdigest()
        if scheme.lower() != "bearer" or not hmac.compare_digest(given, digest):
            raise ProxyError(ErrorKind.UNAUTHENTICATED,
                             f"{rpc}: the model repository API needs 'authorization: Bearer "
                             f"<admin token>' (the listeners.admin token)")
        name = config.v2_backend()
        assert name is not None  # the config refuses repository_api without one
        return self.runtime.backends[name]

    def serves(self, model: str) -> bool:
        """Whether ``model`` is one of the current runtime's routes (shared memory is read only
        for a call that has one)."""
        return model in self.runtime.served

    def contract(self, model: str, version: str = "") -> ModelContract:
        """The served contract, under the name clients use (raises NOT_FOUND / UNAVAILABLE,
        and INVALID_ARGUMENT for a version Triton would not read), for a version the backend
        has when the client names one."""
        version = model_version(version)
        if model not in self.runtime.served:
            raise unknown_model(model)
        contract = self.runtime.contract(model)
        if version and contract.versions and version not in contract.versions:
            raise unknown_model(model, version)
        return contract

    def model_stats(self, model: str = "", version: str = ""
                    ) -> dict[str, tuple[str, ModelStats]]:
        """Each model's ``ModelStats``, and the version its entry names (as Triton writes it)."""
        version = model_version(version)
        if model and model not in self.runtime.served:
            raise unknown_model_statistics(model)
        contracts = self.runtime.contracts
        return {name: (contracts[name].statistics_version(name, version) if name in contracts
                       else version, self.stats.get(name, ModelStats()))
                for name in ([model] if model else self.runtime.served)}

    # --- inference --------------------------------------------------------------------------

    async def infer(self, call: Call, finish: Finish | None = None,
                    by_read: bool = False) -> Reply:
        """One call through its route, counted and traced with what its client got. A stream
        is settled at its end, not its start (``_watched``). ``finish`` runs on each answer
        (a unary one, each of a stream's) before it is counted; a failure of it replaces the
        answer, so the front sends that failure. ``by_read``: a backend's server-sent events
        that no filter wrapped come as one ``SseEvents`` per backend read (``SseStream``)."""
        if not tracing_on():
            return await self._infer(call, None, finish, by_read)
        scheme = "https" if self.runtime.config.listeners.http.tls is not None else "http"
        name, attrs = server_span(call, scheme)
        span = _tracer.start_span(name, context=propagate.extract(call.headers),
                                  kind=trace.SpanKind.SERVER, attributes=attrs)
        token = otel_context.attach(trace.set_span_in_context(span))
        try:
            return await self._infer(call, span, finish, by_read)
        except BaseException:
            # cancelled: the client left, or its deadline passed (_infer counted it)
            late = call.deadline is not None and time.monotonic() >= call.deadline - 0.005
            _end_span(span, call, LocalReply(
                ErrorKind.DEADLINE_EXCEEDED if late else ErrorKind.CANCELLED,
                "the call was cancelled before its answer"))
            raise
        finally:
            otel_context.detach(token)

    async def _infer(self, call: Call, span: Span | None, finish: Finish | None,
                     by_read: bool = False) -> Reply:
        runtime = self.runtime  # the call's, to its end: a reload swaps in another for the next
        route = runtime.served.get(call.model)  # an internal route: as unknown as any name
        # Unknown names share one label value, so a scan of names cannot blow up cardinality.
        model = call.model if route is not None else "(unknown)"
        backend = route.spec.backend if route is not None else ""
        m = self.telemetry.request_metrics(model, backend, call.front)
        m.in_flight.inc()
        runtime.enter()
        start = time.perf_counter_ns()
        try:
            reply = await self._handle(call, route, runtime)
            if isinstance(reply, Result) and reply.stream is None and finish is not None:
                reply = await _finished(call, reply, finish)
        except asyncio.CancelledError:
            # The client went away or its deadline passed (grpc.aio cancels the handler): the
            # call still counts, so the metrics agree with what the clients saw.
            m.in_flight.dec()
            runtime.leave()
            late = call.deadline is not None and time.monotonic() >= call.deadline - 0.005
            self._settle(call, route, m, None, "deadline_exceeded" if late else "cancelled",
                         time.perf_counter_ns() - start)
            raise
        except BaseException:
            runtime.leave()  # the chain's guard answers every failure; this is the last resort
            raise
        if isinstance(reply, Result) and reply.stream is not None:
            stream = reply.stream
            if by_read and isinstance(stream, SseStream):
                stream = stream.reads()
            reply.stream = self._watched(call, route, m, start, stream, span, finish, runtime)
            return reply  # in flight, and not yet counted, until the stream ends
        m.in_flight.dec()
        runtime.leave()
        # Injected faults are counted apart, so no dashboard or alert takes them for the model's.
        self._settle(call, route, m, reply, _code(reply), time.perf_counter_ns() - start)
        if span is not None:
            _end_span(span, call, reply if isinstance(reply, LocalReply) else None)
        return reply

    def _settle(self, call: Call, route: Route | None, m: RequestMetrics, reply: Reply | None,
                code: str, elapsed_ns: int, latency_ns: int | None = None) -> None:
        """Count a finished call with the code its client saw. ``latency_ns``: a stream's time
        to its first event (its whole length is ``mmguard_stream_duration_seconds``)."""
        model = call.model if route is not None else "(unknown)"
        backend = route.spec.backend if route is not None else ""
        if (by := call.state.get(ANSWERED_BY)) is not None:  # a lighter level, the cache
            backend, m = by, self.telemetry.request_metrics(model, by, call.front)
        self.telemetry.count_request(m, model, backend, call.front, code)
        self.telemetry.observe_latency(m, (latency_ns or elapsed_ns) / 1e9)
        m.request_bytes.inc(call.nbytes)
        self.telemetry.access(call, code, elapsed_ns / 1e9)
        if route is not None:
            self._account(call, reply, elapsed_ns)
            if reply is not None and call.state.get(CANARY):  # what observers judge: canaries
                for observe in self.runtime.observers:
                    observe(call, reply, elapsed_ns / 1e9)

    async def _watched(self, call: Call, route: Route | None, m: RequestMetrics, start: int,
                       stream: AsyncIterator[StreamItem], span: Span | None,
                       finish: Finish | None, runtime: Runtime
                       ) -> AsyncGenerator[StreamItem, None]:
        """The backend's stream as the client gets it, settled when it ends: a failure before
        the first event counts with its own code (the client got that status), one after it
        as ``stream_broken`` (the client got 200 and a broken answer), a client that left
        before the end as ``cancelled``."""
        first_ns: int | None = None
        failure: LocalReply | None = None
        broken = False
        ended = False
        items = _last_word(stream)
        try:
            async for item in items:
                is_first = first_ns is None
                if is_first:
                    first_ns = time.perf_counter_ns()
                if isinstance(item, Result) and finish is not None:
                    item = await _finished(call, item, finish)
                if isinstance(item, LocalReply):
                    failure, broken = item, not is_first
                    yield item
                    break
                said = None if failure is not None else stream_error(item)
                if said is not None:  # after the stream's 200: broken, whichever event it is
                    failure, broken = said, True
                yield item
            else:
                if first_ns is None and call.api is Api.OPENAI:  # the client would get nothing
                    backend = call.target.backend if call.target else ""
                    failure = LocalReply(ErrorKind.BAD_GATEWAY, f"backend '{backend}' ended "
                                         f"the stream of model '{call.model}' before its "
                                         "first event")
                    yield failure
            ended = True
        finally:
            await items.aclose()
            m.in_flight.dec()
            runtime.leave()
            elapsed = time.perf_counter_ns() - start
            late = call.deadline is not None and time.monotonic() >= call.deadline - 0.005
            if not ended and failure is None:
                failure = LocalReply(*((ErrorKind.DEADLINE_EXCEEDED, "the deadline passed")
                                       if late else (ErrorKind.CANCELLED, "the client left")))
                broken = first_ns is not None
            code = _code(failure) if failure is not None else "ok"
            if broken and code not in ("injected", "cancelled") and not (
                    late and code == "deadline_exceeded"):  # the client's deadline: as it says
                code = STREAM_BROKEN
            self._settle(call, route, m, failure or Result(call.model), code, elapsed,
                         None if first_ns is None else first_ns - start)
            if span is not None:
                _end_span(span, call, failure, broken)

    def count_undecoded(self, front: str, err: ProxyError) -> None:
        """A request refused before it became a call (unreadable body, unknown model on the
        OpenAI front, too large): counted too, under model ``(undecoded)``, so that what
        clients were told shows in ``mmguard_requests_total`` whatever refused it."""
        m = self.telemetry.request_metrics(UNDECODED, "", front)
        self.telemetry.count_request(m, UNDECODED, "", front, err.kind.value)

    async def _handle(self, call: Call, route: Route | None, runtime: Runtime) -> Reply:
        """The call's route, found once by ``_infer`` in ``runtime``, runs it (None: no such
        model)."""
        refused = call.state.get(REFUSED)
        if refused is not None:  # before the route, by the front (its shared memory)
            return refused
        try:  # first, as Triton does: a version it cannot read is refused for every model
            call.version = model_version(call.version)
        except ProxyError as err:
            return LocalReply.from_error(err)
        if route is None:
            return LocalReply.from_error(unknown_model(call.model))
        why = self._route_unservable(route)
        if why is not None:
            return LocalReply(ErrorKind.FAILED_PRECONDITION, why)
        return await runtime.handle(call, route)

    def _account(self, call: Call, reply: Reply | None, elapsed_ns: int) -> None:
        """The per-model statistics the v2 statistics endpoints report (no reply: the call
        was cancelled, a failure)."""
        st = self.stats.setdefault(call.model, ModelStats())
        if isinstance(reply, Result):
            st.success_count += 1
            st.success_ns += elapsed_ns
            if ANSWERED_BY not in call.state:  # the route's own model ran (not L2, not L3)
                st.execution_count += 1
                st.inference_count += _batch_size(call)
                st.last_inference_ms = int(time.time() * 1000)
        else:
            st.fail_count += 1
            st.fail_ns += elapsed_ns

    async def stream(self, call: Call, finish: Finish | None = None,
                     by_read: bool = False) -> AsyncGenerator[StreamItem, None]:
        """Each response of a streamed call as it comes; errors become a LocalReply item.
        ``finish`` and ``by_read``: as ``infer``'s."""
        call.streaming = True
        reply = await self.infer(call, finish, by_read)
        if isinstance(reply, LocalReply) or reply.stream is None:
            yield reply
            return
        stream = reply.stream
        try:
            async for item in stream:
                yield item
        finally:
            close = getattr(stream, "aclose", None)
            if close is not None:  # a client that left cancels the backend call now
                await close()


UNDECODED = "(undecoded)"
"""The model label of requests refused before they could be read as a call."""
STREAM_BROKEN = "stream_broken"
"""A stream that failed after its first event (its client got 200 and a broken answer)."""


def _code(reply: Reply) -> str:
    """``mmguard_requests_total``'s code for an answer (injected faults apart)."""
    if isinstance(reply, Result):
        return "ok"
    return "injected" if reply.injected else reply.kind.value


async def _finished(call: Call, result: Result, finish: Finish) -> Result | LocalReply:
    """The answer after the front's last step on it, or that step's failure (what the client
    gets instead of the answer)."""
    try:
        await finish(result)
    except ProxyError as err:
        return LocalReply.from_error(err)
    except Exception as exc:  # whatever it is, the client gets a 500 for it
        log.debug("answer of model %r failed to encode", call.model, exc_info=True)
        return LocalReply(ErrorKind.INTERNAL, f"mmguard could not encode the answer of model "
                          f"'{call.model}': {type(exc).__name__}: {exc}")
    return result


async def _last_word(stream: AsyncIterator[StreamItem]) -> AsyncGenerator[StreamItem, None]:
    """A backend stream that never ends without a last word: an exception becomes its last
    item (a LocalReply); the backend stream is closed with it."""
    try:
        async for item in stream:
            yield item
    except ProxyError as exc:
        yield LocalReply.from_error(exc)
    except Exception as exc:
        yield LocalReply(ErrorKind.INTERNAL, f"stream failed: {type(exc).__name__}: {exc}")
    except asyncio.CancelledError:
        if not cancelled_under():
            raise
        log.exception("stream of a call: a step was cancelled although the call was not")
        yield LocalReply(ErrorKind.INTERNAL, "stream failed: a step of the stream was "
                         "cancelled although the call was not")
    finally:
        close = getattr(stream, "aclose", None)
        if close is not None:
            await close()


def _end_span(span: Span, call: Call, failure: LocalReply | None, broken: bool = False) -> None:
    """The SERVER span's status as the client saw it, then its end. A broken stream keeps
    the status its client already got (200 / OK) and says why in an error event."""
    if failure is None:
        end_server_span(span, call, None, 200, grpc.StatusCode.OK)
    else:
        span.set_status(trace.StatusCode.ERROR, failure.message)
        if broken:
            span.add_event(STREAM_BROKEN if failure.kind is not ErrorKind.CANCELLED
                           else "client_left",
                           {"error.type": failure.kind.value, "mmguard.detail": failure.message})
            end_server_span(span, call, STREAM_BROKEN if failure.kind is not
                            ErrorKind.CANCELLED else failure.kind.value, 200, grpc.StatusCode.OK)
        else:
            status = STATUS[failure.kind]
            end_server_span(span, call, failure.kind.value, failure.status or status.http,
                            status.grpc)
    span.end()


def _batch_size(call: Call) -> int:
    return max(call.inputs[0].shape[0], 1) if call.inputs and call.inputs[0].shape else 1
