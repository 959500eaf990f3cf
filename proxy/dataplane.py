"""The data plane both fronts share: health, metadata, statistics and inference over the current
runtime, with the request-level span, metrics and statistics done once, here, for every front."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from opentelemetry import propagate, trace

from proxy import __version__
from proxy.call import CANARY, Call, LocalReply, Reply, Result, StreamItem
from proxy.contract import ModelContract
from proxy.errors import STATUS, ErrorKind, ProxyError
from proxy.runtime import Runtime
from proxy.telemetry import Telemetry, end_server_span, server_span, tracing_on

EXTENSIONS = ("classification", "binary_tensor_data", "statistics", "model_configuration")
_tracer = trace.get_tracer("mmguard")


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

    # --- health and metadata ----------------------------------------------------------------

    def live(self) -> bool:
        return True

    async def ready(self) -> bool:
        return not self.draining and await self.runtime.ready()

    async def model_ready(self, model: str, version: str = "") -> bool:
        return not self.draining and await self.runtime.model_ready(model, version)

    def server_metadata(self) -> dict[str, object]:
        return {"name": "mmguard", "version": __version__, "extensions": list(EXTENSIONS)}

    def contract(self, model: str) -> ModelContract:
        """The served contract, under the name clients use (raises NOT_FOUND / UNAVAILABLE)."""
        return self.runtime.contract(model)

    def model_stats(self, model: str = "") -> dict[str, ModelStats]:
        if model:
            if model not in self.runtime.routes:
                raise ProxyError(ErrorKind.NOT_FOUND, f"model '{model}' is not served by mmguard")
            return {model: self.stats.get(model, ModelStats())}
        return {name: self.stats.get(name, ModelStats()) for name in self.runtime.routes}

    # --- inference --------------------------------------------------------------------------

    async def infer(self, call: Call) -> Reply:
        if not tracing_on():
            return await self._infer(call)
        ctx = propagate.extract(call.headers)
        name, attrs = server_span(call)
        with _tracer.start_as_current_span(name, context=ctx, kind=trace.SpanKind.SERVER,
                                           attributes=attrs) as span:
            reply = await self._infer(call)
            if isinstance(reply, LocalReply):
                span.set_status(trace.StatusCode.ERROR, reply.message)
                status = STATUS[reply.kind]
                end_server_span(span, call, reply.kind.value, reply.status or status.http,
                                status.grpc.value[0])
            else:
                end_server_span(span, call, None, 200, 0)
        return reply

    async def _infer(self, call: Call) -> Reply:
        route = self.runtime.routes.get(call.model)
        # Unknown names share one label value, so a scan of names cannot blow up cardinality.
        model = call.model if route is not None else "(unknown)"
        backend = route.spec.backend if route is not None else ""
        m = self.telemetry.request_metrics(model, backend, call.front)
        m.in_flight.inc()
        start = time.perf_counter_ns()
        try:
            reply = await self.runtime.handle(call)
        except asyncio.CancelledError:
            # The client went away or its deadline passed (grpc.aio cancels the handler): the
            # call still counts, so the metrics agree with what the clients saw.
            elapsed = time.perf_counter_ns() - start
            late = call.deadline is not None and time.monotonic() >= call.deadline - 0.005
            code = "deadline_exceeded" if late else "cancelled"
            self.telemetry.count_request(m, model, backend, call.front, code)
            self.telemetry.observe_latency(m, elapsed / 1e9)
            if route is not None:
                self._account(call, None, elapsed)
            raise
        finally:
            m.in_flight.dec()
        elapsed = time.perf_counter_ns() - start
        # Injected faults are counted apart, so no dashboard or alert takes them for the model's.
        code = ("ok" if isinstance(reply, Result) else
                "injected" if reply.injected else reply.kind.value)
        self.telemetry.count_request(m, model, backend, call.front, code)
        self.telemetry.observe_latency(m, elapsed / 1e9)
        m.request_bytes.inc(call.nbytes)
        self.telemetry.access(call, code, elapsed / 1e9)
        if route is not None:
            self._account(call, reply, elapsed)
            if call.state.get(CANARY):
                for observe in self.runtime.store.get("observers", {}).values():
                    observe(call, reply, elapsed / 1e9)
        return reply

    def _account(self, call: Call, reply: Reply | None, elapsed_ns: int) -> None:
        """The per-model statistics the v2 statistics endpoints report (no reply: the call
        was cancelled, a failure)."""
        st = self.stats.setdefault(call.model, ModelStats())
        if isinstance(reply, Result):
            st.success_count += 1
            st.success_ns += elapsed_ns
            st.execution_count += 1
            st.inference_count += _batch_size(call)
            st.last_inference_ms = int(time.time() * 1000)
        else:
            st.fail_count += 1
            st.fail_ns += elapsed_ns

    async def stream(self, call: Call) -> AsyncGenerator[StreamItem, None]:
        """Each response of a streamed call as it comes; errors become a LocalReply item."""
        call.streaming = True
        reply = await self.infer(call)
        if isinstance(reply, LocalReply) or reply.stream is None:
            yield reply
            return
        stream = reply.stream
        try:
            async for item in stream:
                yield item
        except ProxyError as exc:
            yield LocalReply.from_error(exc)
        except Exception as exc:  # a stream never ends without a last word to the client
            yield LocalReply(ErrorKind.INTERNAL, f"stream failed: {type(exc).__name__}: {exc}")
        finally:
            close = getattr(stream, "aclose", None)
            if close is not None:  # a client that left cancels the backend call now
                await close()


def _batch_size(call: Call) -> int:
    if call.inputs and call.inputs[0].shape:
        return max(call.inputs[0].shape[0], 1)
    return 1
